"""The helper that runs one slot process with a PTY (or pipes), inside the slot.

Stdlib-only, Python 3.6+: it runs as ``python3`` *in the slot* (its uid, namespaces,
cgroup, working directory and exported variables: the slot's shell starts it), so it is
shipped as text (:data:`SOURCE`) written to the slot's control directory. It connects
to the agent's socket (``argv[1]``), starts ``bash SCRIPT`` (``argv[5]``) in a new
session on a new terminal of ``argv[2]`` rows and ``argv[3]`` columns (``argv[4]``:
``1`` a PTY, ``0`` pipes), and relays; with ``argv[6]`` it also appends the output to
that file (a background job's log). Frames both ways: one type byte, a 4-byte
big-endian length, the payload. Agent to helper: ``i`` input, ``r`` resize
(``b"ROWS COLS"``), ``s`` a signal number for the process group, ``e`` end of input,
``g`` go (the agent found the process in ``/proc``: until then it waits before
``exec``). Helper to agent: ``p`` the process's pid (a hint: the agent reads ``/proc``), ``o`` output, ``x`` the exit status (``-N``:
killed by signal N). When the agent's side closes, the process group is killed.
"""

SOURCE = r'''
import fcntl, os, select, signal, socket, struct, sys, termios


def main():
    path, rows, cols, use_pty, script = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    log = open(sys.argv[6], "ab", buffering=0) if len(sys.argv) > 6 else None

    def send(kind, data):
        sock.sendall(kind + struct.pack(">I", len(data)) + data)

    if use_pty:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        out_fd = in_fd = master
    else:
        in_r, in_fd = os.pipe()
        out_fd, out_w = os.pipe()
    sync_r, sync_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.close(sync_w)  # the parent goes on once the process group exists
            os.close(go_w)
            os.read(go_r, 1)  # and this one once the agent has found it in /proc
            if use_pty:
                fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
                for fd in (0, 1, 2):
                    os.dup2(slave, fd)
            else:
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(out_w, 2)
            os.closerange(3, 65536)  # the log too
            for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGQUIT):  # `&` ignored INT, QUIT
                signal.signal(sig, signal.SIG_DFL)
            os.execvp("bash", ["bash", script])
        finally:
            os._exit(127)
    os.close(sync_w)
    os.read(sync_r, 1)
    os.close(sync_r)
    os.close(go_r)
    if use_pty:
        os.close(slave)
    else:
        os.close(in_r)
        os.close(out_w)
    send(b"p", str(pid).encode())
    buf = b""
    reading = True
    pause = 0.001  # after the output ends, the exit is polled for at 1, 2, 4 ... 50 ms
    while True:
        ready = select.select([sock] + ([out_fd] if reading else []), [], [], None if reading else pause)[0]
        pause = pause if reading else min(pause * 2, 0.05)
        if out_fd in ready:
            try:
                data = os.read(out_fd, 65536)
            except OSError:  # EIO: the terminal's last user closed it
                data = b""
            if data:
                if log is not None:
                    try:
                        log.write(data)
                    except OSError:
                        pass
                send(b"o", data)
            else:
                reading = False
        if sock in ready:
            chunk = sock.recv(65536)
            if not chunk:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                return
            buf += chunk
            while len(buf) >= 5:
                kind, size = buf[:1], struct.unpack(">I", buf[1:5])[0]
                if len(buf) < 5 + size:
                    break
                data, buf = buf[5:5 + size], buf[5 + size:]
                try:
                    if kind == b"i" and in_fd is not None:
                        os.write(in_fd, data)
                    elif kind == b"r" and use_pty:
                        r, c = (int(v) for v in data.split())
                        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", r, c, 0, 0))
                    elif kind == b"g" and go_w is not None:
                        os.close(go_w)
                        go_w = None
                    elif kind == b"s":
                        os.killpg(pid, int(data))
                    elif kind == b"e" and in_fd is not None:
                        if use_pty:
                            os.write(in_fd, b"\x04")
                        else:
                            os.close(in_fd)
                            in_fd = None
                except OSError:
                    pass
        if not reading:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                send(b"x", str(code).encode())
                return


main()
'''
