"""Open a page in a real headless Chromium (Debian package `chromium`) through the DevTools protocol.

    python tests/history/headless.py PAGE.html SHOT.png [WIDTH HEIGHT]

``load(page)`` returns console errors / exceptions, the result of a JavaScript expression evaluated in the
page, and a PNG screenshot. The browser runs with the flags that keep it off the network and away from
the user's profile; the DevTools endpoint is found through the DevToolsActivePort file Chromium writes.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]


def chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Page:
    def __init__(self, ws):
        self.ws, self.next_id, self.events = ws, 0, []

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)
        raise TimeoutError(method)

    def wait_event(self, name: str, timeout: float = 30) -> dict:
        end = time.monotonic() + timeout
        for e in self.events:
            if e.get("method") == name:
                return e
        while time.monotonic() < end:
            msg = json.loads(self.ws.recv())
            self.events.append(msg)
            if msg.get("method") == name:
                return msg
        raise TimeoutError(name)

    def errors(self) -> list[str]:
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:500])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"log ({p['entry'].get('source')}): {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out


def load(page: Path, expression: str = "document.title", width: int = 1280, height: int = 900,
         timeout: float = 60) -> dict:
    """{'errors': [...], 'value': <expression's value>, 'png': bytes} for the page in headless Chromium."""
    import websocket   # websocket-client
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (Debian: apt-get install -y chromium)")
    profile = Path(tempfile.mkdtemp(prefix="forge-chromium-"))
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port_file = profile / "DevToolsActivePort"
        end = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > end:
                raise TimeoutError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        target = next(t for t in targets if t.get("type") == "page")
        ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True)
        try:
            p = Page(ws)
            for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
                p.call(domain)
            p.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
            p.call("Page.navigate", url=Path(page).absolute().as_uri())
            p.wait_event("Page.loadEventFired", timeout)
            value = p.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")
            png = base64.b64decode(p.call("Page.captureScreenshot", format="png")["data"])
            time.sleep(0.2)   # late console messages
            try:
                p.call("Runtime.evaluate", expression="1", returnByValue=True)
            except Exception:
                pass
            return {"errors": p.errors(), "value": value, "png": png}
        finally:
            ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    w, h = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1280, 900)
    res = load(Path(sys.argv[1]), width=w, height=h)
    Path(sys.argv[2]).write_bytes(res["png"])
    print(json.dumps({"errors": res["errors"], "title": res["value"]}))
    sys.exit(1 if res["errors"] else 0)
