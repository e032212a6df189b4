"""The admin API in eight steps: tenant, key, adapter upload, a call, status, pinning,
rotation, cleanup.

    loragate serve --admin-key secret
    python examples/admin_walkthrough.py --admin-key secret [--adapter DIR]

--adapter is a PEFT directory to upload (default: a copy of the last public adapter the
gateway serves, found through its adapter list). Every step prints the request and the answer.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import uuid
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI


def show(step: str, response: httpx.Response) -> Any:
    body = response.json()
    print(f"\n## {step}\n{response.request.method} {response.request.url.path} -> "
          f"{response.status_code}\n{json.dumps(body, indent=2)[:900]}")
    response.raise_for_status()
    return body


def tar_directory(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(directory, arcname=directory.name)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--adapter", type=Path, default=None)
    args = parser.parse_args(argv)
    suffix = uuid.uuid4().hex[:6]
    tenant, adapter = f"walkthrough-{suffix}", f"walkthrough-bot-{suffix}"
    admin = httpx.Client(base_url=args.base_url, timeout=120.0,
                         headers={"Authorization": f"Bearer {args.admin_key}"})
    source = args.adapter
    if source is None:
        listed = sorted((a["name"], a["path"]) for a in admin.get("/admin/adapters").json()
                        if a["owner"] is None)
        if not listed:
            raise SystemExit("the gateway serves no public adapter to copy: pass --adapter DIR")
        source = Path(listed[-1][1])

    show("1. create a tenant (60 requests/minute, tier 1)", admin.post(
        "/admin/tenants", json={"tenant_id": tenant, "rpm": 60, "priority": 1}))
    key = show("2. issue its API key (shown once)",
               admin.post(f"/admin/tenants/{tenant}/keys"))["key"]
    show("3. upload an adapter it owns (a PEFT directory as .tar.gz, validated first)",
         admin.post(f"/admin/adapters/upload?name={adapter}&owner={tenant}",
                    content=tar_directory(source)))

    client = OpenAI(base_url=args.base_url + "/v1", api_key=key)
    print("\n## 4. the tenant calls its adapter (loaded on every engine when it was registered)")
    print("models it sees:", [m.id for m in client.models.list()])
    reply = client.chat.completions.create(
        model=adapter, messages=[{"role": "user", "content": "Hello!"}], max_tokens=16)
    print("answer:", reply.choices[0].message.content, "| usage:", reply.usage)

    show("5. the adapter's status: where it is resident, requests and tokens served",
         admin.get(f"/admin/adapters/{adapter}"))
    show("6. pin it on every instance so it is never evicted",
         admin.post(f"/admin/adapters/{adapter}/pin", json={"pinned": True}))
    key_id = admin.get(f"/admin/tenants/{tenant}/keys").json()[0]["key_id"]
    new_key = show("7. rotate the key: the old one stops working at once",
                   admin.post(f"/admin/tenants/{tenant}/keys/{key_id}/rotate"))["key"]
    old = httpx.get(args.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    new = httpx.get(args.base_url + "/v1/models",
                    headers={"Authorization": f"Bearer {new_key}"})
    print(f"old key -> {old.status_code}, new key -> {new.status_code}")

    admin.post(f"/admin/adapters/{adapter}/pin", json={"pinned": False})
    show("8. clean up: delete the adapter, then the tenant (and its keys)",
         admin.delete(f"/admin/adapters/{adapter}"))
    show("   ", admin.delete(f"/admin/tenants/{tenant}"))


if __name__ == "__main__":
    main()
