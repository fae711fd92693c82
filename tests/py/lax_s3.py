"""An S3 stand-in that ignores conditional writes, for the shared cache's probe test.

It keeps objects as files under ROOT (the request path, bucket included), checks no signature,
and answers every PUT with 200: `If-None-Match: *` is ignored, as some S3-compatible servers
do. nemo-dag must find that out before it writes a record, and then write none.

    python3 lax_s3.py PORT ROOT
"""

import hashlib
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

ROOT = sys.argv[2]


def where(path: str) -> str:
    rel = unquote(urlsplit(path).path).lstrip("/")
    if ".." in rel.split("/"):
        raise ValueError(rel)
    return os.path.join(ROOT, rel)


class Lax(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status: int, body: bytes = b"", headers=None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def missing(self):
        body = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>'
        self.answer(404, body, {"Content-Type": "application/xml"})

    def do_PUT(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        path = where(self.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(body)
        self.answer(200, b"", {"ETag": '"%s"' % hashlib.md5(body).hexdigest()})

    def do_GET(self):
        path = where(self.path)
        if not os.path.isfile(path):
            return self.missing()
        with open(path, "rb") as f:
            body = f.read()
        self.answer(
            200,
            body,
            {
                "ETag": '"%s"' % hashlib.md5(body).hexdigest(),
                "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
                "Content-Type": "application/octet-stream",
            },
        )

    do_HEAD = do_GET

    def do_DELETE(self):
        path = where(self.path)
        if os.path.isfile(path):
            os.remove(path)
        self.answer(204)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Lax).serve_forever()
