"""A small client for jaxserve's gRPC API: sync and async generate that yield chunks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
from google.protobuf import json_format

from server.protos.jaxserve.v1 import inference_pb2 as pb
from server.protos.jaxserve.v1 import inference_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


Prompt = str | list[int] | list[dict]


def make_request(prompt: Prompt, request_id: str = "", lora_name: str = "",
                 images: list[bytes] = (), priority: int = 0, cache_salt: str = "",
                 **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text, token ids, or a conversation: a list of
    {"role", "content"} messages for the model's chat template, content a string or a list
    of {"type": "text", "text": str} and {"type": "image", "image": image file bytes}
    parts) and SamplingParams fields; `lora_name`: a LoRA adapter the server serves
    (empty: the base model); `images`: a text or token-id prompt's, one per image
    placeholder; `priority` and `cache_salt` as GenerateRequest's."""
    req = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling),
                             lora_name=lora_name, images=list(images), priority=priority,
                             cache_salt=cache_salt)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.messages.extend(_message(m) for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _message(m: dict) -> pb.ChatMessage:
    content = m["content"]
    if isinstance(content, str):
        return pb.ChatMessage(role=m["role"], content=content)
    return pb.ChatMessage(role=m["role"], parts=[
        pb.ContentPart(image=p["image"]) if p.get("type") == "image"
        else pb.ContentPart(text=p["text"]) for p in content])


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call (TLS or not)."""

    def __init__(self, api_key: str):
        self.header = ("authorization", f"Bearer {api_key}")

    def _with_key(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


def _read(path: str | None) -> bytes | None:
    return open(path, "rb").read() if path else None


def _channel(target: str, api_key: str | None, tls_ca: str | None,
             tls_cert: tuple[str, str] | None = None) -> grpc.Channel:
    """Plaintext, or TLS trusting `tls_ca` (a PEM file; "" for the system's roots) and
    showing `tls_cert` (client certificate and key files, for mutual TLS); with `api_key`,
    every call carries it."""
    if tls_ca is None:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        cert, key = tls_cert or (None, None)
        channel = grpc.secure_channel(
            target, grpc.ssl_channel_credentials(_read(tls_ca), _read(key), _read(cert)),
            options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, _BearerKey(api_key)) if api_key else channel


class Client:
    """Blocking client. `generate` yields GenerateResponse messages (chunks, then complete).
    `api_key`, `tls_ca` and `tls_cert` (certificate, key) for a server started with
    --api-key / --tls-cert / --tls-client-ca."""

    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None,
                 tls_ca: str | None = None, tls_cert: tuple[str, str] | None = None):
        self.channel = _channel(target, api_key, tls_ca, tls_cert)
        self.stub = pb_grpc.InferenceStub(self.channel)

    def generate(self, prompt: Prompt, request_id: str = "", timeout: float | None = None,
                 **sampling) -> Iterator[pb.GenerateResponse]:
        yield from self.stub.Generate(make_request(prompt, request_id, **sampling), timeout=timeout)

    def complete(self, prompt: Prompt, **sampling) -> tuple[list[int], str, pb.Complete]:
        """Run to the end: (token ids, text, the Complete message)."""
        ids, text, done = [], "", None
        for msg in self.generate(prompt, **sampling):
            if msg.HasField("chunk"):
                ids += msg.chunk.token_ids
                text += msg.chunk.text
            else:
                done = msg.complete
        return ids, text, done

    def abort(self, *request_ids: str) -> int:
        return self.stub.Abort(pb.AbortRequest(request_ids=request_ids)).num_aborted

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(
            text=text, add_special_tokens=add_special_tokens)).ids)

    def embed(self, inputs: list[str | list[int]], dimensions: int | None = None,
              normalize: bool | None = None, lora_name: str = "",
              timeout: float | None = None) -> list[list[float]]:
        """Each input's (text or token ids) embedding (the Embed RPC)."""
        response = self.stub.Embed(pb.EmbedRequest(
            inputs=_inputs(inputs), dimensions=dimensions, normalize=normalize, lora_name=lora_name),
            timeout=timeout)
        return [list(e.values) for e in response.embeddings]

    def classify(self, inputs: list[str | list[int]], use_activation: bool | None = None,
                 lora_name: str = "", timeout: float | None = None
                 ) -> list[pb.Classification]:
        """Each input's class probabilities and label (the Classify RPC)."""
        return list(self.stub.Classify(pb.ClassifyRequest(
            inputs=_inputs(inputs), use_activation=use_activation, lora_name=lora_name),
            timeout=timeout).classifications)

    def score(self, queries: str | list[str], documents: list[str],
              use_activation: bool | None = None, lora_name: str = "",
              timeout: float | None = None) -> list[float]:
        """Each (query, document) pair's score (the Score RPC), in the documents' order."""
        queries = [queries] if isinstance(queries, str) else queries
        response = self.stub.Score(pb.ScoreRequest(
            queries=queries, documents=documents, use_activation=use_activation,
            lora_name=lora_name), timeout=timeout)
        return [s.score for s in response.scores]

    def info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest())

    def status(self) -> pb.ServerStatus:
        return self.stub.GetServerStatus(pb.GetServerStatusRequest())

    def close(self) -> None:
        self.channel.close()


def _inputs(inputs: list[str | list[int]]) -> list[pb.EmbedInput]:
    return [pb.EmbedInput(text=x) if isinstance(x, str)
            else pb.EmbedInput(token_ids=pb.TokenIds(ids=x)) for x in inputs]


class AsyncClient:
    """asyncio client; `generate` is an async iterator of GenerateResponse messages."""

    def __init__(self, target: str = "127.0.0.1:50051"):
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.InferenceStub(self.channel)

    async def generate(self, prompt: Prompt, request_id: str = "",
                       timeout: float | None = None, **sampling
                       ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(make_request(prompt, request_id, **sampling), timeout=timeout)
        async for msg in call:
            yield msg

    async def status(self) -> pb.ServerStatus:
        return await self.stub.GetServerStatus(pb.GetServerStatusRequest())

    async def close(self) -> None:
        await self.channel.close()


def chat(client: Client, args: argparse.Namespace, lines, out) -> list[dict]:
    """Read user turns from `lines`, stream each reply to `out`; returns the conversation."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling["seed"] = args.seed
    while True:
        out.write("> ")
        out.flush()
        line = lines.readline()
        if not line.strip():
            out.write("\n")
            return messages
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = ""
        for msg in client.generate(messages, **sampling):
            if msg.HasField("chunk"):
                reply += msg.chunk.text
                out.write(msg.chunk.text)
                out.flush()
        out.write("\n")
        messages.append({"role": "assistant", "content": reply})


def _text_or_file(value: str) -> str:
    return Path(value).read_text() if os.path.isfile(value) else value


def structured_outputs(args: argparse.Namespace) -> pb.StructuredOutputs | None:
    """The output constraint `jaxserve client generate` was given, if any."""
    if args.json_schema:
        return pb.StructuredOutputs(json_schema=_text_or_file(args.json_schema))
    if args.json_object:
        return pb.StructuredOutputs(json_object=True)
    if args.regex:
        return pb.StructuredOutputs(regex=args.regex)
    if args.choice:
        return pb.StructuredOutputs(choice=pb.Choices(choices=args.choice))
    if args.grammar:
        return pb.StructuredOutputs(grammar=_text_or_file(args.grammar))
    return None


def run_cli(args: argparse.Namespace) -> int:
    client = Client(args.target, args.api_key, args.tls_ca)
    try:
        if args.client_command == "generate":
            sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature)
            if args.seed is not None:
                sampling["seed"] = args.seed
            constraint = structured_outputs(args)
            if constraint is not None:
                sampling["structured_outputs"] = constraint
            text = ""
            for msg in client.generate(args.prompt, **sampling):
                if msg.HasField("chunk"):
                    text += msg.chunk.text
                    if args.stream:
                        print(msg.chunk.text, end="", flush=True)
                else:
                    print("" if args.stream else text)
                    print(json_format.MessageToJson(msg.complete))
        elif args.client_command == "chat":
            chat(client, args, sys.stdin, sys.stdout)
        elif args.client_command == "status":
            print(json_format.MessageToJson(client.status()))
        else:
            print(json_format.MessageToJson(client.info()))
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0
