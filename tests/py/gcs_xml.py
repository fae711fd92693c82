"""A stand-in for Google Cloud Storage's XML API, for the shared cache's gs:// test.

No emulator that can be installed here keeps create-only writes (gcp-storage-emulator accepts a
second create and answers no HEAD or multipart upload; fake-gcs-server has no XML multipart), so
the test runs against this one, written from the XML API's reference
(https://cloud.google.com/storage/docs/xml-api/overview). It keeps objects as files under ROOT,
checks no credentials, and does what the cache relies on:

  PUT    /BUCKET/OBJECT                 store; with `x-goog-if-generation-match: 0`, 412 if it exists
  GET    /BUCKET/OBJECT  [Range]        the object, or the range of it (206)
  HEAD   /BUCKET/OBJECT
  DELETE /BUCKET/OBJECT
  POST   /BUCKET/OBJECT?uploads         start a multipart upload
  PUT    /BUCKET/OBJECT?partNumber=N&uploadId=U
  POST   /BUCKET/OBJECT?uploadId=U      complete it: the object appears only now
  DELETE /BUCKET/OBJECT?uploadId=U      abort

    python3 gcs_xml.py PORT ROOT
"""

import hashlib
import os
import re
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

ROOT = sys.argv[2]
UPLOADS = os.path.join(ROOT, ".uploads")


def etag(body: bytes) -> str:
    return '"%s"' % hashlib.md5(body).hexdigest()


class Gcs(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def target(self):
        url = urlsplit(self.path)
        rel = unquote(url.path).lstrip("/")
        if ".." in rel.split("/") or "/" not in rel:
            raise ValueError(rel)
        return os.path.join(ROOT, rel), parse_qs(url.query, keep_blank_values=True)

    def answer(self, status: int, body: bytes = b"", headers=None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, status: int, code: str):
        body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code></Error>".encode()
        self.answer(status, body, {"Content-Type": "application/xml"})

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def do_PUT(self):
        path, query = self.target()
        body = self.body()
        if "uploadId" in query:
            upload = os.path.join(UPLOADS, query["uploadId"][0])
            if not os.path.isdir(upload):
                return self.error(404, "NoSuchUpload")
            with open(os.path.join(upload, "%06d" % int(query["partNumber"][0])), "wb") as f:
                f.write(body)
            return self.answer(200, b"", {"ETag": etag(body)})
        if self.headers.get("x-goog-if-generation-match") == "0" and os.path.exists(path):
            return self.error(412, "PreconditionFailed")
        self.store(path, body)
        self.answer(200, b"", {"ETag": etag(body), "x-goog-generation": "1"})

    def store(self, path: str, body: bytes):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staged = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(staged, "wb") as f:
            f.write(body)
        os.replace(staged, path)

    def do_POST(self):
        path, query = self.target()
        body = self.body()
        if "uploads" in query:
            upload_id = uuid.uuid4().hex
            os.makedirs(os.path.join(UPLOADS, upload_id))
            xml = f"<InitiateMultipartUploadResult><UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>"
            return self.answer(200, xml.encode(), {"Content-Type": "application/xml"})
        if "uploadId" in query:
            upload = os.path.join(UPLOADS, query["uploadId"][0])
            numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
            data = b""
            for n in numbers:
                with open(os.path.join(upload, "%06d" % n), "rb") as f:
                    data += f.read()
            self.store(path, data)
            xml = f"<CompleteMultipartUploadResult><ETag>{etag(data)}</ETag></CompleteMultipartUploadResult>"
            return self.answer(200, xml.encode(), {"Content-Type": "application/xml"})
        self.error(400, "InvalidArgument")

    def do_GET(self):
        path, _ = self.target()
        if not os.path.isfile(path):
            return self.error(404, "NoSuchKey")
        with open(path, "rb") as f:
            data = f.read()
        headers = {
            "ETag": etag(data),
            "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
            "Content-Type": "application/octet-stream",
        }
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted and self.command == "GET":
            start = int(wanted.group(1))
            end = int(wanted.group(2)) if wanted.group(2) else len(data) - 1
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self.answer(206, data[start : end + 1], headers)
        self.answer(200, data, headers)

    do_HEAD = do_GET

    def do_DELETE(self):
        path, query = self.target()
        if "uploadId" in query:
            return self.answer(204)
        if not os.path.isfile(path):
            return self.error(404, "NoSuchKey")
        os.remove(path)
        self.answer(204)


if __name__ == "__main__":
    os.makedirs(UPLOADS, exist_ok=True)
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Gcs).serve_forever()
