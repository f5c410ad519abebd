"""Single-instance answers computed once and given again: what the accuracy scripts'
runs of one model compare their P/D deployments with.

``scripts/run_accuracy_test.sh`` starts a reference instance and has it compute the whole
prompt set, in every run; for SmolLM2 that is a start and about twenty seconds of a core.
Its cases of one model ask that instance the same requests, and a single instance answers
a greedy request alike every time, so the tests start one real ``both`` instance per model
(:class:`References`) and point the script at it (``REFERENCE_URL``) through a
:class:`RecordedReference`: an HTTP front that passes each request (path and body) on the
first time it is asked, keeps the instance's 200 answer, and gives that answer when asked
the same again. A request it has not seen is always computed by the instance.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from sidecars import Sidecar, SidecarGroup, Spec

Reply = tuple[int, bytes, str]  # status, body, content type


class RecordedReference:
    """An HTTP front on 127.0.0.1 (:attr:`url`) for ``instance``; :meth:`close` stops it.
    ``computed`` and ``repeated`` count the requests passed on and those answered again."""

    def __init__(self, instance: Sidecar) -> None:
        self.instance = instance
        self.computed = self.repeated = 0
        self._answers: dict[tuple[str, bytes], Reply] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.front = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="recorded-reference")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def answer(self, method: str, path: str, body: bytes) -> Reply:
        """A POST asked before: the kept answer; anything else: the instance's answer now."""
        key = (path, body)
        with self._lock:
            kept = self._answers.get(key) if method == "POST" else None
            self.repeated += kept is not None
        if kept is not None:
            return kept
        got = self.instance.client.request(method, f"{self.instance.url}{path}", content=body,
                                           headers={"content-type": "application/json"},
                                           timeout=httpx.Timeout(300.0))
        reply = (got.status_code, got.content, got.headers.get("content-type", ""))
        if method == "POST" and got.status_code == 200:
            with self._lock:
                self._answers[key] = reply
                self.computed += 1
        return reply

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the instance itself offers

    def do_GET(self) -> None:
        self._reply(self._front().answer("GET", self.path, b""))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self._reply(self._front().answer("POST", self.path, body))

    def _front(self) -> RecordedReference:
        return self.server.front  # type: ignore[attr-defined,no-any-return]

    def _reply(self, reply: Reply) -> None:
        status, body, content_type = reply
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # no line on stderr per request


class References:
    """One recorded reference per model, its instance started on first use: the one
    run_accuracy_test.sh starts (``both``, TP 1, LBHNC, 16-token blocks, 256 blocks, KV on
    the CPU). A context manager; closing stops every instance."""

    def __init__(self, log_dir: Path) -> None:
        self.group = SidecarGroup(log_dir)
        self.fronts: dict[str, RecordedReference] = {}

    def url(self, model: str) -> str:
        if model not in self.fronts:
            spec = Spec("both", extra=("--model", model, "--device", "cpu"))
            self.fronts[model] = RecordedReference(self.group.start_one(spec))
        return self.fronts[model].url

    def close(self) -> None:
        try:
            for front in self.fronts.values():
                front.close()
        finally:
            self.group.close()

    def __enter__(self) -> References:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
