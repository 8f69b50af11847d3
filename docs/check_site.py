"""The built docs site seen as a reader sees it: headless Chromium opens the
landing page, the vLLM guide and a benchmark page from ``build/site``, checks
each renders (header, navigation, content, stylesheets, images), drives the
search box until it lists results, collects every console error, and writes a
screenshot of each page to ``build/docs-shots/``.

Process: this script; an HTTP server for the site on a thread of its own
(a free port on 127.0.0.1: Material's search runs in a web worker, which a
``file://`` page cannot start) and one Chromium child, driven over the
DevTools protocol on a pipe (``--remote-debugging-pipe``: standard library
only). Who calls: ``make docs-check`` (after ``make docs``), not ``make test``
(CI machines may have no Chromium). Blocks for about 10 s.

Off-site requests (Material asks Google Fonts for Roboto) are blocked unless
``--online``: the check is hermetic and quick without network, and the pages
fall back to system fonts. Failures of blocked off-site requests are listed
as notes, not errors; every other console error fails the page.

Prints a line per check and per page, ``PASS`` or ``FAIL``; exits 1 when any
page fails, 2 when Chromium or the site is missing.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import http.server
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@dataclass(frozen=True)
class Page:
    """A page to open, the screenshot's name, and a search that must find ``expect``."""

    path: str
    shot: str
    query: str
    expect: str


PAGES = (
    Page("", "landing.png", "vllm", "guides/vllm/"),
    Page("guides/vllm/", "guide-vllm.png", "HiCache", "guides/sglang/"),
    Page("benchmarks/policies/", "bench-policies.png", "Belady", "benchmarks/policies/"),
)

# What the page reports about itself once loaded: JSON from one evaluation.
INSPECT_JS = r"""
(() => {
  const vis = (el) => { if (!el) return false; const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== "hidden"; };
  const header = document.querySelector("header.md-header");
  const nav = document.querySelector("nav.md-nav--primary");
  const article = document.querySelector("article.md-content__inner");
  const h1 = article ? article.querySelector("h1") : null;
  const input = document.querySelector('input[data-md-component="search-query"]');
  const sheets = [...document.querySelectorAll('link[rel="stylesheet"]')]
    .filter((l) => l.href.startsWith(location.origin));
  const imgs = [...document.querySelectorAll("article img")];
  return JSON.stringify({
    title: document.title,
    header: vis(header),
    headerTitle: header ? header.innerText.trim().split("\n")[0] : "",
    headerSticky: header ? getComputedStyle(header).position : "",
    navLinks: nav ? [...nav.querySelectorAll("a.md-nav__link")].filter(vis).length : 0,
    navActive: nav ? (nav.querySelector("a.md-nav__link--active") || {}).textContent || "" : "",
    h1: h1 ? h1.textContent.replace("\u00b6", "").trim() : "",
    articleChars: article ? article.innerText.length : 0,
    searchInput: vis(input),
    sheets: sheets.length,
    sheetsLoaded: sheets.filter((l) => l.sheet !== null).length,
    imgs: imgs.length,
    imgsBroken: imgs.filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.src),
  });
})()
"""

SEARCH_JS = r"""
(() => {
  const items = [...document.querySelectorAll(".md-search-result__item a")];
  const meta = document.querySelector(".md-search-result__meta");
  return JSON.stringify({
    meta: meta ? meta.textContent.trim() : "",
    hrefs: items.map((a) => a.href),
  });
})()
"""


class CDPError(RuntimeError):
    """The browser answered a command with an error, or did not answer in time."""


class Browser:
    """One headless Chromium child, spoken to over ``--remote-debugging-pipe``:
    JSON messages, each ended by a NUL byte, written to its fd 3 and read from
    its fd 4. Events are kept in ``events`` as they come, for the caller."""

    def __init__(self, exe: str, log: Path, online: bool) -> None:
        self.profile = tempfile.mkdtemp(prefix="kvtier-docs-chromium-")
        to_child_r, self.to_child = _pipe_above(10)
        self.from_child, from_child_w = _pipe_above(10)
        args = [
            exe,
            "--headless",
            "--remote-debugging-pipe",
            f"--user-data-dir={self.profile}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--mute-audio",
            "--enable-logging=stderr",
            "--v=0",
        ]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox.
        if not online:
            args.append("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        args.append("about:blank")
        log.parent.mkdir(parents=True, exist_ok=True)
        self.pid = os.posix_spawn(
            exe,
            args,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
                (os.POSIX_SPAWN_DUP2, 1, 2),
                (os.POSIX_SPAWN_DUP2, to_child_r, 3),
                (os.POSIX_SPAWN_DUP2, from_child_w, 4),
            ],
            setsid=True,  # its own process group: close() ends the renderers with it.
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """Send a command and wait for its answer, keeping events that come meanwhile."""
        self.next_id += 1
        my_id = self.next_id  # _event may number messages of its own meanwhile
        msg: dict[str, Any] = {"id": my_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self.to_child, data) :]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply is None:
                raise CDPError(f"{method}: no answer in {timeout:.0f} s")
            if reply.get("id") == my_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error'].get('message')}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self._event(reply)

    def pump(self, seconds: float) -> None:
        """Take events for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (msg := self._read(deadline)) is not None:
            if "method" in msg:
                self._event(msg)

    def wait_event(self, method: str, session: str, timeout: float) -> dict[str, Any] | None:
        """The first event ``method`` of ``session`` (kept or still to come)."""
        seen = len(self.events)
        for ev in self.events:
            if ev["method"] == method and ev.get("sessionId") == session:
                return ev
        deadline = time.monotonic() + timeout
        while (msg := self._read(deadline)) is not None:
            if "method" in msg:
                self._event(msg)
            for ev in self.events[seen:]:
                if ev["method"] == method and ev.get("sessionId") == session:
                    return ev
            seen = len(self.events)
        return None

    def _event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        if ev["method"] == "Target.attachedToTarget":
            # A worker of a page (Material's search worker): its console counts too.
            child = ev["params"]["sessionId"]
            for method in ("Runtime.enable", "Log.enable", "Runtime.runIfWaitingForDebugger"):
                self.next_id += 1
                msg = {"id": self.next_id, "method": method, "params": {}, "sessionId": child}
                os.write(self.to_child, json.dumps(msg).encode() + b"\0")

    def _read(self, deadline: float) -> dict[str, Any] | None:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.from_child], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.from_child, 1 << 20)
            if not chunk:
                raise CDPError("the browser closed its pipe (crashed? see its log)")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        msg: dict[str, Any] = json.loads(raw)
        return msg

    def close(self) -> None:
        with contextlib.suppress(CDPError, OSError):
            self.send("Browser.close", timeout=5)
        for _ in range(50):
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                break
            time.sleep(0.1)
        else:
            os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.to_child)
        os.close(self.from_child)
        shutil.rmtree(self.profile, ignore_errors=True)


def _pipe_above(low: int) -> tuple[int, int]:
    """A pipe whose ends are numbered at least ``low`` (close-on-exec), so that
    dup2 onto the child's fds 3 and 4 never lands on one of them."""
    r, w = os.pipe()
    ends = (fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, low), fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, low))
    os.close(r)
    os.close(w)
    return ends


@dataclass
class ServerLog:
    """Every request the site's server answered, with its status."""

    requests: list[tuple[str, int]] = field(default_factory=list)


def serve(site: Path, log: ServerLog) -> http.server.ThreadingHTTPServer:
    """``site`` over HTTP on a free port of 127.0.0.1, on a daemon thread."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            log.requests.append((self.path, int(code) if str(code).isdigit() else 0))

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(Handler, directory=str(site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _evaluate(b: Browser, session: str, expr: str) -> dict[str, Any]:
    r = b.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)
    if "exceptionDetails" in r:
        raise CDPError(f"evaluate: {r['exceptionDetails'].get('text')}")
    out: dict[str, Any] = json.loads(r["result"]["value"])
    return out


def _console_errors(b: Browser, sessions: set[str], origin: str) -> tuple[list[str], list[str]]:
    """Console errors of these sessions (page and workers): (errors, off-site notes)."""
    errors: list[str] = []
    notes: list[str] = []
    for ev in b.events:
        if ev.get("sessionId") not in sessions:
            continue
        p = ev.get("params", {})
        if ev["method"] == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            text = d.get("exception", {}).get("description") or d.get("text", "")
            errors.append(f"uncaught: {text.splitlines()[0] if text else '?'} ({d.get('url', '')})")
        elif ev["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(
                str(a.get("value", a.get("description", ""))) for a in p.get("args", [])
            )
            errors.append(f"console.{p['type']}: {args}")
        elif ev["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
            e = p["entry"]
            url = e.get("url", "")
            line = f"{e.get('source', '')}: {e.get('text', '')} {url}".strip()
            (errors if not url or url.startswith(origin) else notes).append(line)
    return errors, notes


def _type(b: Browser, session: str, text: str) -> None:
    """Type ``text`` as a user does: a key down and up per character."""
    for ch in text:
        b.send(
            "Input.dispatchKeyEvent",
            {"type": "keyDown", "text": ch, "key": ch, "unmodifiedText": ch},
            session,
        )
        b.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": ch}, session)


def check_page(
    b: Browser, origin: str, page: Page, shots: Path, width: int, height: int, search_shot: bool
) -> bool:
    url = f"{origin}/{page.path}"
    print(f"== {url}")
    target = b.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = b.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    ok = True

    def check(cond: bool, what: str) -> None:
        nonlocal ok
        ok = ok and cond
        print(f"  {'PASS' if cond else 'FAIL'}  {what}")

    try:
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            b.send(method, {}, session)
        b.send(
            "Target.setAutoAttach",
            {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True},
            session,
        )
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        b.send("Emulation.setDeviceMetricsOverride", metrics, session)
        nav = b.send("Page.navigate", {"url": url}, session)
        check("errorText" not in nav, f"navigates ({nav.get('errorText', 'ok')})")
        loaded = b.wait_event("Page.loadEventFired", session, 30)
        check(loaded is not None, "load event")
        b.pump(1.0)  # Material's scripts and the search worker settle.
        statuses = [
            ev["params"]["response"]["status"]
            for ev in b.events
            if ev["method"] == "Network.responseReceived"
            and ev.get("sessionId") == session
            and ev["params"]["type"] == "Document"
        ]
        check(statuses[:1] == [200], f"HTTP status {statuses[:1]}")

        s = _evaluate(b, session, INSPECT_JS)
        check(s["header"] and s["headerTitle"] == "kvtier", f"header shown: {s['headerTitle']!r}")
        check(
            s["headerSticky"] == "sticky",
            f"Material's stylesheet applied (header position {s['headerSticky']!r})",
        )
        check(
            s["sheets"] > 0 and s["sheetsLoaded"] == s["sheets"],
            f"stylesheets loaded: {s['sheetsLoaded']}/{s['sheets']}",
        )
        check(
            s["navLinks"] >= 10,
            f"navigation: {s['navLinks']} links shown, active {s['navActive'].strip()!r}",
        )
        check(
            bool(s["h1"]) and s["articleChars"] > 200,
            f"content: h1 {s['h1']!r}, {s['articleChars']} characters",
        )
        check(not s["imgsBroken"], f"images: {s['imgs']} in the article, broken {s['imgsBroken']}")
        check(s["searchInput"], "search box shown")

        shot = shots / page.shot
        png = b.send("Page.captureScreenshot", {"format": "png"}, session)["data"]
        shot.write_bytes(base64.b64decode(png))
        print(f"  ----  screenshot {shot.relative_to(ROOT) if shot.is_relative_to(ROOT) else shot}")

        b.send(
            "Runtime.evaluate",
            {
                "expression": "document.querySelector('input[data-md-component=\"search-query\"]').focus()"
            },
            session,
        )
        _type(b, session, page.query)
        found: dict[str, Any] = {"meta": "", "hrefs": []}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            b.pump(0.25)
            found = _evaluate(b, session, SEARCH_JS)
            if found["hrefs"]:
                break
        # Links carry ?h=<query> (search.highlight) and #anchors: compare paths.
        hit = any(urlsplit(h).path == "/" + page.expect for h in found["hrefs"])
        check(
            hit,
            f"search {page.query!r}: {found['meta'] or 'no results'}; {page.expect} among them: {hit}",
        )
        if search_shot:
            shot = shots / page.shot.replace(".png", "-search.png")
            png = b.send("Page.captureScreenshot", {"format": "png"}, session)["data"]
            shot.write_bytes(base64.b64decode(png))
            print(
                f"  ----  screenshot {shot.relative_to(ROOT) if shot.is_relative_to(ROOT) else shot}"
            )

        sessions = {session} | {
            ev["params"]["sessionId"]
            for ev in b.events
            if ev["method"] == "Target.attachedToTarget" and ev.get("sessionId") == session
        }
        errors, notes = _console_errors(b, sessions, origin)
        check(not errors, f"console errors: {len(errors)}")
        for e in errors:
            print(f"        {e}")
        for n in notes:
            print(f"  note  off-site, blocked or failed: {n}")
    except CDPError as e:
        check(False, str(e))
    finally:
        with contextlib.suppress(CDPError):
            b.send("Target.closeTarget", {"targetId": target})
    print(f"{'PASS' if ok else 'FAIL'}  {url}")
    return ok


def find_browser(name: str | None) -> str | None:
    for cand in (name,) if name else BROWSERS:
        path = shutil.which(cand) if cand else None
        if path:
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--site", type=Path, default=ROOT / "build" / "site", help="the built site (make docs)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "build" / "docs-shots",
        help="screenshots and the browser's log",
    )
    ap.add_argument(
        "--browser",
        default=os.environ.get("CHROMIUM"),
        help="Chromium's executable (default: found on PATH)",
    )
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=2000)
    ap.add_argument(
        "--online", action="store_true", help="let pages fetch off-site resources (Google Fonts)"
    )
    args = ap.parse_args(argv)

    exe = find_browser(args.browser)
    if exe is None:
        print("FAIL  no Chromium on PATH (apt-get install chromium, or --browser / CHROMIUM=)")
        return 2
    index = args.site / "search" / "search_index.json"
    if not (args.site / "index.html").is_file() or not index.is_file():
        print(f"FAIL  no built site with a search index in {args.site} (make docs)")
        return 2
    docs = json.loads(index.read_text()).get("docs", [])
    print(f"PASS  search index: {index.relative_to(args.site)}, {len(docs)} entries")
    if not docs:
        return 1

    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.png"):
        old.unlink()
    log = ServerLog()
    server = serve(args.site, log)
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    browser_log = args.out / "chromium.log"
    b = Browser(exe, browser_log, args.online)
    results = []
    try:
        version = b.send("Browser.getVersion")
        net = "online" if args.online else "off-site requests blocked"
        print(f"----  {version.get('product')}, site at {origin}, {net}")
        for i, page in enumerate(PAGES):
            results.append(
                check_page(b, origin, page, args.out, args.width, args.height, search_shot=i == 0)
            )
    except CDPError as e:
        print(f"FAIL  browser: {e} (log: {browser_log})")
        results.append(False)
    finally:
        b.close()
        server.shutdown()

    bad = [(p, c) for p, c in log.requests if c >= 400]
    served_ok = not bad
    print(
        f"{'PASS' if served_ok else 'FAIL'}  server: {len(log.requests)} requests, {len(bad)} failed {bad[:5]}"
    )
    ok = all(results) and len(results) == len(PAGES) and served_ok
    print(
        f"{'PASS' if ok else 'FAIL'}  docs-check: {sum(results)}/{len(PAGES)} pages; screenshots in {args.out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
