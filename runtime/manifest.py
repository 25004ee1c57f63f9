"""Read an artifact's manifest.json, validate it completely (k3mk.runtime.schema) and check it
against this runtime and the device, with errors that say what to rebuild."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from k3mk.runtime import abi
from k3mk.runtime.schema import ARCH_OF_CAPABILITY, MANIFEST_FILE, MANIFEST_VERSION, ArtifactError, check_file, validate
from k3mk.runtime.table import FORMAT_VERSION

__all__ = ["ARCH_OF_CAPABILITY", "MANIFEST_VERSION", "ArtifactError", "Manifest", "check_device", "check_versions", "load_manifest"]


@dataclass(frozen=True)
class Manifest:
    path: Path  # the artifact directory
    data: dict

    def __getitem__(self, key: str):
        return self.data[key]

    def file(self, role: str) -> Path:
        return self.path / self.data["files"][role]

    def read_file(self, role: str) -> bytes:
        """The file's bytes, checked against the hash the build recorded."""
        path = self.file(role)
        try:
            blob = path.read_bytes()
        except OSError as e:
            raise ArtifactError(f"{path}: the artifact's {role} cannot be read ({e.strerror})") from None
        check_file(self.path, self.data, role, blob)
        return blob

    def check_files(self) -> None:
        """Every listed file present, inside the directory and matching its hash (reads them all)."""
        for role in self.data["files"]:
            check_file(self.path, self.data, role)


def load_manifest(artifact_dir: str | Path) -> Manifest:
    """The artifact's manifest, validated against the schema and this runtime's ABI (no GPU needed)."""
    path = Path(artifact_dir)
    file = path / MANIFEST_FILE
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} has no {MANIFEST_FILE}: not a k3mk artifact, or its build did not finish") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{file}: not a readable JSON manifest ({e})") from None
    try:
        validate(data)
    except ArtifactError as e:
        raise ArtifactError(f"{file}: {e}") from None
    m = Manifest(path, data)
    check_versions(m)
    return m


def check_versions(m: Manifest) -> None:
    if m.data.get("manifest_version") != MANIFEST_VERSION:  # also checked by the schema; kept for hand-made Manifests
        raise ArtifactError(f"manifest version {m.data.get('manifest_version')}; this runtime reads {MANIFEST_VERSION}")
    if m["task_table_format"] != FORMAT_VERSION:
        raise ArtifactError(f"task table format {m['task_table_format']}; this runtime reads {FORMAT_VERSION}")
    profile = bool(m.data.get("profile", False))
    abi_version = abi.PROFILE_ABI_VERSION if profile else abi.ABI_VERSION
    if m["abi_version"] != abi_version or m["params"] != abi.params_json():
        raise ArtifactError(
            f"kernel parameter ABI {m['abi_version']} {[p['name'] for p in m['params']]} differs from this "
            f"runtime's {abi_version} {[p.name for p in abi.PARAMS]}: rebuild with this k3mk"
        )
    if m["control_words"] != abi.CONTROL_WORDS or m["debug_words_per_cta"] != abi.DEBUG_WORDS:
        raise ArtifactError("control / debug word counts differ from this runtime's: rebuild with this k3mk")
    if profile and (m["profile_words_per_task"], m["profile_ring_steps"]) != (abi.PROFILE_WORDS, abi.PROFILE_RING_STEPS):
        raise ArtifactError("profile record layout differs from this runtime's: rebuild with this k3mk")


def check_device(m: Manifest, capability: tuple[int, int], sm_count: int, name: str = "this GPU") -> None:
    """The artifact runs only on its arch, and needs one co-resident CTA per task list."""
    arch = ARCH_OF_CAPABILITY.get(tuple(capability))
    if arch != m["arch"]:
        raise ArtifactError(
            f"artifact built for {m['arch']} (compute capability {tuple(m['compute_capability'])}), but {name} "
            f"is compute capability {tuple(capability)} ({arch or 'unsupported'}): rebuild for that arch"
        )
    if m["num_ctas"] > sm_count:
        raise ArtifactError(
            f"artifact needs {m['num_ctas']} co-resident CTAs (one per task list) but {name} has {sm_count} SMs: "
            f"rebuild with sm_count={sm_count}"
        )
