"""Modal's client API: session, apps, images, secrets and sandboxes."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from ._common import _BUILDER_VERSION, _MESSAGES, GenericResult, _hash_id, _new_id
from ._network import access_of
from ._processes import _Sandbox
from ._records import _IMAGES, ImageRecord, SandboxRecord, _Secret


class _ControlPlaneHandlers:
    """Modal's client API: session, apps, images, secrets and sandboxes.

    A part of :class:`LocalModalServer` (a mixin): it uses the server's state.
    """

    # -- control plane: session, apps, images, secrets -------------------------------------------
    async def _client_hello(self, req: Any, stream: Any) -> api_pb2.ClientHelloResponse:
        return api_pb2.ClientHelloResponse(image_builder_version=_BUILDER_VERSION)

    async def _auth_token_get(self, req: Any, stream: Any) -> api_pb2.AuthTokenGetResponse:
        return api_pb2.AuthTokenGetResponse(token=self._signer.token(sub=self.token_id))

    async def _environment_get_or_create(self, req: Any, stream: Any) -> Any:
        name = req.deployment_name or "main"
        if name != "main":
            raise GRPCError(Status.NOT_FOUND, f"Environment '{name}' not found")
        return api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-local", metadata=api_pb2.EnvironmentMetadata(
                name=name, settings=api_pb2.EnvironmentSettings(image_builder_version=_BUILDER_VERSION)))

    async def _app_get_or_create(self, req: Any, stream: Any) -> api_pb2.AppGetOrCreateResponse:
        key = (req.environment_name or "main", req.app_name)
        app_id = self._apps.get(key)
        if app_id is None:
            if req.object_creation_type not in (api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING,
                                                api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS):
                raise GRPCError(Status.NOT_FOUND,
                                f"App '{req.app_name}' not found in environment '{key[0]}'")
            app_id = self._apps[key] = _new_id("ap")
            self._app_names[app_id] = req.app_name
        elif req.object_creation_type == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
            raise GRPCError(Status.ALREADY_EXISTS, f"App '{req.app_name}' already exists")
        return api_pb2.AppGetOrCreateResponse(app_id=app_id)

    async def _app_list(self, req: Any, stream: Any) -> api_pb2.AppListResponse:
        env = req.environment_name or "main"
        items = []
        for (app_env, name), app_id in self._apps.items():
            if app_env != env:
                continue
            running = sum(1 for r in self.sandboxes.values()
                          if r.app_id == app_id and r.status == "running")
            items.append(api_pb2.AppListResponse.AppListItem(
                app_id=app_id, name=name, description=name, state=api_pb2.APP_STATE_DEPLOYED,
                n_running_tasks=running))
        return api_pb2.AppListResponse(apps=items)

    async def _image_get_or_create(self, req: Any, stream: Any) -> api_pb2.ImageGetOrCreateResponse:
        image = req.image
        bases = [_IMAGES.get(b.image_id) or self.images.get(b.image_id) for b in image.base_images]
        if any(b is None for b in bases):
            raise GRPCError(Status.NOT_FOUND, "Base image not found")
        commands = [c for b in bases if b for c in b.commands] + list(image.dockerfile_commands)
        tag = next((b.tag for b in bases if b), "")
        for line in image.dockerfile_commands:
            if line.upper().startswith("FROM ") and not image.base_images:
                tag = line.split()[1]
        python = next((b.python_version for b in bases if b and b.python_version), None)
        if tag.startswith("python:") and python is None:  # debian_slim(): python:3.11.12-slim...
            python = tag.split(":", 1)[1].split("-", 1)[0]
        mount = self._mounts.get(image.context_mount_id, "")
        if mount.startswith("python-build-standalone."):  # ...<release>.<version>-<libc>
            python = mount.split(".", 2)[2].rsplit("-", 1)[0]
        payload = json.dumps([commands, [b.image_id for b in image.base_images], req.builder_version,
                              sorted(f.filename for f in image.context_files), mount]).encode()
        image_id = _hash_id("im", payload)
        record = ImageRecord(image_id, tag, commands, req.builder_version, python)
        self.images[image_id] = record
        if image_id in _IMAGES and not req.force_build:
            return api_pb2.ImageGetOrCreateResponse(
                image_id=image_id, result=api_pb2.GenericResult(status=GenericResult.GENERIC_STATUS_SUCCESS),
                metadata=self._image_metadata(record))
        return api_pb2.ImageGetOrCreateResponse(image_id=image_id)

    async def _mount_get_or_create(self, req: Any, stream: Any) -> api_pb2.MountGetOrCreateResponse:
        """Mounts are recorded by name (``add_python`` uses a global one), never stored."""
        name = req.deployment_name
        payload = name or json.dumps(sorted((f.filename, f.sha256_hex) for f in req.files))
        mount_id = _hash_id("mo", payload.encode())
        self._mounts[mount_id] = name
        return api_pb2.MountGetOrCreateResponse(mount_id=mount_id)

    async def _mount_put_file(self, req: Any, stream: Any) -> api_pb2.MountPutFileResponse:
        return api_pb2.MountPutFileResponse(exists=True)

    @staticmethod
    def _image_metadata(record: ImageRecord) -> api_pb2.ImageMetadata:
        return api_pb2.ImageMetadata(image_builder_version=record.builder_version, workdir="/")

    async def _image_join_streaming(self, req: Any, stream: Any) -> api_pb2.ImageJoinStreamingResponse:
        record = self.images.get(req.image_id)
        if record is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        for match, message in self._failing_images:
            if match in record.tag:
                return api_pb2.ImageJoinStreamingResponse(
                    result=api_pb2.GenericResult(status=GenericResult.GENERIC_STATUS_FAILURE,
                                                 exception=message), eof=True)
        _IMAGES[record.image_id] = record
        return api_pb2.ImageJoinStreamingResponse(
            result=api_pb2.GenericResult(status=GenericResult.GENERIC_STATUS_SUCCESS), eof=True,
            metadata=self._image_metadata(record))

    async def _secret_get_or_create(self, req: Any, stream: Any) -> api_pb2.SecretGetOrCreateResponse:
        env = req.environment_name or "main"
        values = dict(req.env_dict)
        kind = req.object_creation_type
        if kind in (api_pb2.OBJECT_CREATION_TYPE_EPHEMERAL, api_pb2.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP):
            secret = _Secret(_new_id("st"), None, values)
            self._secrets[secret.secret_id] = secret
        else:
            secret_id = self._named_secrets.get((env, req.deployment_name))
            if kind == api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS and secret_id:
                raise GRPCError(Status.ALREADY_EXISTS, f"Secret '{req.deployment_name}' already exists")
            if kind in (api_pb2.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS,
                        api_pb2.OBJECT_CREATION_TYPE_CREATE_OVERWRITE_IF_EXISTS):
                secret_id = secret_id or _new_id("st")
                self._secrets[secret_id] = _Secret(secret_id, req.deployment_name, values)
                self._named_secrets[(env, req.deployment_name)] = secret_id
            if secret_id is None:
                raise GRPCError(Status.NOT_FOUND,
                                f"Secret '{req.deployment_name}' not found in environment '{env}'")
            secret = self._secrets[secret_id]
            missing = [k for k in req.required_keys if k not in secret.values]
            if missing:
                raise GRPCError(Status.NOT_FOUND, f"Secret '{req.deployment_name}' is missing "
                                                  f"required keys: {', '.join(missing)}")
        return api_pb2.SecretGetOrCreateResponse(
            secret_id=secret.secret_id,
            metadata=api_pb2.SecretMetadata(name=secret.name or "", keys=sorted(secret.values),
                                            environment_name=env))

    def _resolve_secrets(self, secret_ids: Any, sources: Any) -> tuple[dict[str, str], list[str], dict[str, str]]:
        """(all env values, named secret names, inline values) of secret ids then sources."""
        values: dict[str, str] = {}
        names: list[str] = []
        inline: dict[str, str] = {}
        refs = [("id", sid) for sid in secret_ids] + [
            ("id", s.secret_id) if s.WhichOneof("source") == "secret_id" else ("env", dict(s.env.contents))
            for s in sources]
        for kind, ref in refs:
            if kind == "env":
                values.update(ref)
                inline.update(ref)
                continue
            secret = self._secrets.get(ref)
            if secret is None:
                raise GRPCError(Status.NOT_FOUND, f"Secret {ref} not found")
            values.update(secret.values)
            if secret.name:
                names.append(secret.name)
            else:
                inline.update(secret.values)
        return values, names, inline

    # -- control plane: sandboxes ---------------------------------------------------------------------
    async def _sandbox_create(self, req: Any, stream: Any) -> Any:
        # Like Modal, a retry with the same x-idempotency-key (the SDK's transient-error
        # retries) gets the sandbox the first attempt made, not a second one.
        key = dict(getattr(stream, "metadata", None) or {}).get("x-idempotency-key")
        reply = self._create_replies.get(key) if key else None
        if reply is None:
            reply = await self._sandbox_create_once(req, stream)
            if key:
                self._create_replies[key] = reply
        if self._lost_create_replies:
            self._lost_create_replies -= 1
            raise GRPCError(Status.UNAVAILABLE, "connection reset before the reply (injected)")
        return reply

    async def _sandbox_create_once(self, req: Any, stream: Any) -> Any:
        v2 = isinstance(req, api_pb2.SandboxCreateV2Request)
        if self._create_failures:
            status, message = self._create_failures.pop(0)
            raise GRPCError(status, message)
        if self._phase != "running":
            raise GRPCError(Status.UNAVAILABLE, "server is stopping")
        app_name = self._app_names.get(req.app_id)
        if app_name is None:
            raise GRPCError(Status.NOT_FOUND, f"App {req.app_id} not found")
        d = req.definition
        image = _IMAGES.get(d.image_id)
        if image is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {d.image_id} not found or not built")
        # V2 sends every secret in order as a source (named ones are in secret_ids too).
        sources = req.secret_sources if v2 else []
        env, names, inline = self._resolve_secrets([] if sources else d.secret_ids, sources)
        if d.HasField("name") and any(s.record.name == d.name and s.record.app_id == req.app_id
                                      and s.result is None for s in self._state_of.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists")
        volumes = self._volume_mounts(d)
        res = d.resources
        gpu = res.gpu_config.gpu_type or None
        if gpu and res.gpu_config.count > 1:
            gpu = f"{gpu}:{res.gpu_config.count}"
        blocked, allowed = access_of(d, self.isolation)
        sandbox_id = _new_id("sb") if not v2 else _new_id("sb", 24)
        now = max(time.time(), self._last_created + 1e-6)  # strictly increasing: list paging
        self._last_created = now
        record = SandboxRecord(
            sandbox_id=sandbox_id, api_version=2 if v2 else 1, app_id=req.app_id, app_name=app_name,
            name=d.name if d.HasField("name") else None, image_id=image.image_id, image_tag=image.tag,
            image_commands=list(image.commands), image_python=image.python_version,
            entrypoint_args=list(d.entrypoint_args),
            workdir=d.workdir if d.HasField("workdir") else None,
            cpu=res.milli_cpu / 1000 if res.milli_cpu else None,
            cpu_limit=res.milli_cpu_max / 1000 if res.milli_cpu_max else None,
            memory_mib=res.memory_mb or None, memory_limit_mib=res.memory_mb_max or None, gpu=gpu,
            timeout_s=d.timeout_secs,
            idle_timeout_s=d.idle_timeout_secs if d.HasField("idle_timeout_secs") else None,
            block_network=blocked, allowed=allowed, tags={t.tag_name: t.tag_value for t in req.tags},
            secret_names=names, env=inline, created_at=now, volumes=volumes,
            state_dir=self.state_dir / "sandboxes" / sandbox_id)  # type: ignore[operator]
        sb = _Sandbox(self, record, env)
        self.sandboxes[sandbox_id] = record
        self._state_of[sandbox_id] = sb
        if self.create_delay_s > 0:
            self._spawn(self._launch(sb, self.create_delay_s))
        else:
            await self._launch(sb, 0)
        if not v2:
            return api_pb2.SandboxCreateResponse(sandbox_id=sandbox_id, metadata=sb.metadata())
        resp = api_pb2.SandboxCreateV2Response(sandbox_id=sandbox_id, metadata=sb.metadata())
        if record.task_id:
            resp.task_id = record.task_id
            resp.command_router_access.CopyFrom(self._access(record.task_id))
        return resp

    def _access(self, task_id: str) -> api_pb2.CommandRouterAccess:
        return api_pb2.CommandRouterAccess(url=self.url, jwt=self._signer.token(task_id=task_id))

    async def _sandbox_get_task_id(self, req: Any, stream: Any) -> api_pb2.SandboxGetTaskIdResponse:
        sb = self._sandbox(req.sandbox_id)
        if req.HasField("timeout") and req.timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sb.started.wait(), req.timeout)
        if sb.result is not None:
            return api_pb2.SandboxGetTaskIdResponse(task_result=sb.result)
        if sb.record.task_id:
            return api_pb2.SandboxGetTaskIdResponse(task_id=sb.record.task_id)
        return api_pb2.SandboxGetTaskIdResponse()

    async def _sandbox_wait(self, req: Any, stream: Any) -> api_pb2.SandboxWaitResponse:
        sb = self._sandbox(req.sandbox_id)
        if req.timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sb.finished.wait(), req.timeout)
        return api_pb2.SandboxWaitResponse(result=sb.result, metadata=sb.metadata())

    async def _sandbox_terminate(self, req: Any, stream: Any) -> api_pb2.SandboxTerminateResponse:
        sb = self._sandbox(req.sandbox_id)
        if sb.result is not None:
            return api_pb2.SandboxTerminateResponse(existing_result=sb.result)
        await self._finish(sb, "terminated", _MESSAGES["terminated"])
        return api_pb2.SandboxTerminateResponse()

    async def _sandbox_list(self, req: Any, stream: Any) -> api_pb2.SandboxListResponse:
        wanted = {t.tag_name: t.tag_value for t in req.tags}
        rows = sorted(self._state_of.values(), key=lambda sb: sb.record.created_at, reverse=True)
        out = api_pb2.SandboxListResponse()
        for sb in rows:
            rec = sb.record
            if ((req.app_id and rec.app_id != req.app_id)
                    or (not req.include_finished and rec.status == "finished")
                    or (req.before_timestamp and rec.created_at >= req.before_timestamp)
                    or any(rec.tags.get(k) != v for k, v in wanted.items())):
                continue
            result = sb.result or api_pb2.GenericResult()
            info = out.sandboxes.add(
                id=rec.sandbox_id, created_at=rec.created_at, app_id=rec.app_id, image_id=rec.image_id,
                name=rec.name or "", timeout_secs=rec.timeout_s,
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in rec.tags.items()])
            info.task_info.CopyFrom(api_pb2.TaskInfo(
                id=rec.task_id or "", started_at=rec.started_at or 0, finished_at=rec.finished_at or 0,
                result=result, sandbox_id=rec.sandbox_id))
            info.metadata.CopyFrom(api_pb2.SandboxHandleMetadata(app_id=rec.app_id))
            if len(out.sandboxes) >= 100:
                break
        return out

    async def _sandbox_tags_get(self, req: Any, stream: Any) -> api_pb2.SandboxTagsGetResponse:
        tags = self._sandbox(req.sandbox_id).record.tags
        return api_pb2.SandboxTagsGetResponse(
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in tags.items()])

    async def _sandbox_tags_set(self, req: Any, stream: Any) -> Any:
        from google.protobuf import empty_pb2

        self._sandbox(req.sandbox_id).record.tags = {t.tag_name: t.tag_value for t in req.tags}
        return empty_pb2.Empty()

    async def _sandbox_get_from_name(self, req: Any, stream: Any) -> api_pb2.SandboxGetFromNameResponse:
        for sb in self._state_of.values():
            if (sb.result is None and sb.record.name == req.sandbox_name
                    and sb.record.app_name == req.app_name):
                return api_pb2.SandboxGetFromNameResponse(sandbox_id=sb.record.sandbox_id,
                                                          metadata=sb.metadata())
        raise GRPCError(Status.NOT_FOUND,
                        f"Sandbox '{req.sandbox_name}' not found in app '{req.app_name}'")

    async def _router_access(self, req: Any, stream: Any) -> Any:
        v2 = isinstance(req, api_pb2.SandboxGetCommandRouterAccessRequest)
        if v2 and req.WhichOneof("target") == "sandbox_id":
            task_id = self._sandbox(req.sandbox_id).record.task_id or ""
        else:
            task_id = req.task_id
        sb = self._tasks_by_id.get(task_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Task {task_id or '(not scheduled)'} not found")
        if sb.result is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, f"Task {task_id} has already finished")
        access = self._access(task_id)
        if v2:
            return api_pb2.SandboxGetCommandRouterAccessResponse(url=access.url, jwt=access.jwt)
        return api_pb2.TaskGetCommandRouterAccessResponse(url=access.url, jwt=access.jwt)

    async def _sandbox_stdin_write(self, req: Any, stream: Any) -> api_pb2.SandboxStdinWriteResponse:
        sb = self._sandbox(req.sandbox_id)
        if req.index > sb.stdin_index:
            sb.stdin_index = req.index
            if sb.entrypoint is not None:
                ep = sb.entrypoint
                await ep.write_stdin(ep.stdin_written, req.input, req.eof)
        return api_pb2.SandboxStdinWriteResponse()

    async def _sandbox_get_logs(self, stream: Any) -> None:
        req = await stream.recv_message()
        sb = self._sandbox(req.sandbox_id)
        log = sb.stdout if req.file_descriptor == api_pb2.FILE_DESCRIPTOR_STDOUT else sb.stderr
        offset = int(req.last_entry_id or 0)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            try:
                chunk = await asyncio.wait_for(log.read(offset), req.timeout or None)
            except asyncio.TimeoutError:
                return  # the SDK asks again from the last entry id
            if chunk is None:
                break
            offset += len(chunk)
            if text := decoder.decode(chunk):
                await stream.send_message(api_pb2.TaskLogsBatch(
                    entry_id=str(offset), items=[api_pb2.TaskLogs(
                        data=text, file_descriptor=req.file_descriptor, timestamp=time.time())]))
        await stream.send_message(api_pb2.TaskLogsBatch(entry_id=str(offset), eof=True))
