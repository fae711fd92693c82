"""Create a blob container on Azurite, the Azure Storage emulator, for the shared cache's tests.

The cache never creates its container (object_store does not), and Azurite takes no anonymous
requests, so this signs the one request with the emulator's published development account
(devstoreaccount1, https://learn.microsoft.com/azure/storage/common/storage-use-azurite).

    python3 azurite_container.py PORT CONTAINER
"""

import base64
import email.utils
import hashlib
import hmac
import http.client
import sys

ACCOUNT = "devstoreaccount1"
KEY = base64.b64decode(
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def main(port: int, container: str) -> int:
    date = email.utils.formatdate(usegmt=True)
    version = "2023-11-03"
    # Shared Key: the verb, eleven standard headers (only Date set), the x-ms-* headers, and the
    # canonical resource with its query parameters: `/account` and then the path, which on the
    # emulator starts with the account again.
    path = f"/{ACCOUNT}/{container}"
    to_sign = "\n".join(["PUT"] + [""] * 5 + [date] + [""] * 5) + "\n"
    to_sign += f"x-ms-version:{version}\n/{ACCOUNT}{path}\nrestype:container"
    signature = base64.b64encode(hmac.new(KEY, to_sign.encode(), hashlib.sha256).digest())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "PUT",
        f"{path}?restype=container",
        headers={
            "Date": date,
            "x-ms-version": version,
            "Content-Length": "0",
            "Authorization": f"SharedKey {ACCOUNT}:{signature.decode()}",
        },
    )
    response = conn.getresponse()
    body = response.read()
    if response.status not in (201, 409):
        print(f"creating container {container}: {response.status} {body!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
