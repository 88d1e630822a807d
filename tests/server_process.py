"""``python -m minipaged serve`` in a child process on a free loopback port (``--port 0``; it
prints the URL it got), for the tests that drive it with real clients."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

MODEL = "tiny"


class ServerProcess:
    def __init__(self, model_dir, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minipaged", "serve", "--model", str(model_dir), "--port", "0",
             "--device", "cpu", "--swap-space", "0.01", "--num-blocks", "256", "--block-size", "4",
             "--served-model-name", MODEL, "--log-stats-interval", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "serving" in line and "http://" in line:
                self.url = line.split(" at ")[1].split()[0]       # http://127.0.0.1:PORT/v1
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {self.proc.stderr.read()[-3000:]}")
        self.base = self.url[:-len("/v1")]

    def stop(self, sig=signal.SIGINT, timeout: float = 30) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out + err
