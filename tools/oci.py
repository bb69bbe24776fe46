#!/usr/bin/env python3
"""Package kvgate.wasm as an OCI image that Istio's Wasm fetcher accepts, and stamp its digests
into the Istio manifests.

The image is the *compat* variant of the Wasm image spec (solo-io/wasm spec/spec-compat.md), the
first format Istio's agent tries (istio/istio pkg/wasm/imagefetcher.go, extractOCIStandardImage):

  manifest   application/vnd.oci.image.manifest.v1+json,
             annotation module.wasm.image/variant=compat
  config     application/vnd.oci.image.config.v1+json
  one layer  application/vnd.oci.image.layer.v1.tar+gzip: a tar holding `plugin.wasm`

written as an OCI image layout directory (oci-layout, index.json, blobs/sha256/<hex>) that
`crane push DIR REF` or `oras cp --from-oci-layout DIR:TAG REF` uploads unchanged, so the
registry's manifest digest is the one printed here.

The output is deterministic: the tar entry has mtime 0, uid/gid 0, no user/group names, mode 0644;
gzip has mtime 0 and no file name; every JSON document is serialised with sorted keys and no
whitespace. The same module gives the same digests (with the same zlib; see docs/istio.md).

What the WasmPlugin `sha256` means depends on the URL scheme (pkg/wasm/cache.go): for `oci://` Istio
compares it with the image *manifest* digest; for `http(s)://` with the module's own sha256; for
`file://` it is not checked at all. `--stamp` writes the right one into each YAML document.

Standard library only. Usage:
  tools/oci.py target/wasm32-wasip1/release/kvgate.wasm                 # -> target/oci/kvgate
  tools/oci.py WASM --out DIR --tag 0.1.0 --stamp target/istio/*.yaml   # also rewrite sha256s
  tools/oci.py WASM --check target/istio/*.yaml                         # exit 1 if stale

istio/*.yaml are checked in with a placeholder digest (64 zeros, which no module has, so an
unstamped manifest fails closed); `./build.sh oci` stamps copies of them in target/istio/.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
# The file name Istio looks for inside the layer (extractWasmPluginBinary).
PLUGIN_FILE = "plugin.wasm"
WASM_MAGIC = b"\0asm"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def layer_tar(module: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(PLUGIN_FILE)
        info.size = len(module)
        info.mode = 0o644
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.type = tarfile.REGTYPE
        tar.addfile(info, io.BytesIO(module))
    return buf.getvalue()


def layer_gzip(tar: bytes) -> bytes:
    buf = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of anything that varies between runs.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(tar)
    return buf.getvalue()


def cargo_version() -> str:
    text = (ROOT / "Cargo.toml").read_text()
    package = text.split("[package]", 1)[-1]
    m = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M)
    return m.group(1) if m else "latest"


def build_image(module: bytes, tag: str):
    """The blobs of the image, keyed by hex digest, and its descriptors."""
    if module[:4] != WASM_MAGIC:
        raise SystemExit("input is not a Wasm module (no \\0asm magic)")
    tar = layer_tar(module)
    layer = layer_gzip(tar)
    config = canonical_json({
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        # diff_ids are digests of the *uncompressed* layers.
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + sha256(tar)]},
    })
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": "sha256:" + sha256(config), "size": len(config)},
        "layers": [{
            "mediaType": LAYER_TYPE,
            "digest": "sha256:" + sha256(layer),
            "size": len(layer),
            "annotations": {"org.opencontainers.image.title": PLUGIN_FILE},
        }],
        # Required by the compat spec for the OCI layer media type.
        "annotations": {"module.wasm.image/variant": "compat"},
    })
    index = canonical_json({
        "schemaVersion": 2,
        "mediaType": INDEX_TYPE,
        "manifests": [{
            "mediaType": MANIFEST_TYPE,
            "digest": "sha256:" + sha256(manifest),
            "size": len(manifest),
            # What `oras cp --from-oci-layout DIR:TAG` and other layout readers resolve a tag by.
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    })
    blobs = {sha256(b): b for b in (layer, config, manifest)}
    return blobs, index, sha256(manifest)


def write_layout(out: Path, blobs: dict, index: bytes) -> None:
    """Writes the layout to a fresh directory and swaps it in, so `out` never holds stale blobs."""
    out = out.resolve()
    if out.exists():
        if not (out / "oci-layout").is_file() and any(out.iterdir()):
            raise SystemExit(f"{out} exists and is not an OCI layout; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        (tmp / "blobs/sha256").mkdir(parents=True)
        for hexdigest, data in blobs.items():
            (tmp / "blobs/sha256" / hexdigest).write_bytes(data)
        (tmp / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
        (tmp / "index.json").write_bytes(index)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- stamping ------------------------------------------------------------------------------------

DOC_SEPARATOR = re.compile(r"^---\s*$", re.M)
URL_LINE = re.compile(r"^\s*(?:url|uri):\s*[\"']?(oci|file|https?)://", re.M)
SHA_LINE = re.compile(r"^(?P<lead>\s*sha256:\s*)(?P<q>[\"']?)(?P<value>[0-9a-f]{64}|nil|)(?P=q)(?P<tail>\s*(?:#.*)?)$", re.M)


def expected_sha(scheme: str, image_digest: str, module_sha: str) -> str:
    # oci: the agent compares against the manifest digest (PrepareFetch's actualDigest);
    # http(s): against sha256 of the downloaded bytes; file: never checked, the module's own
    # sha256 is recorded so the manifest still names the build it expects.
    return image_digest if scheme == "oci" else module_sha


def stamp_text(text: str, image_digest: str, module_sha: str, path: str = "<text>"):
    """Rewrites every `sha256:` line of each YAML document according to that document's URL.
    Returns the new text and a list of (line, old, new) changes. Line-based, so comments and
    layout survive."""
    out, changes = [], []
    # Split keeping separators so the file is reassembled byte for byte.
    pos = 0
    pieces = []
    for m in DOC_SEPARATOR.finditer(text):
        pieces.append(text[pos:m.start()])
        pieces.append(m.group(0))
        pos = m.end()
    pieces.append(text[pos:])
    line_base = 0
    for i, piece in enumerate(pieces):
        if i % 2 == 1:  # a separator
            out.append(piece)
            line_base += piece.count("\n")
            continue
        shas = list(SHA_LINE.finditer(piece))
        if shas:
            schemes = set(URL_LINE.findall(piece))
            if len(schemes) != 1:
                raise SystemExit(f"{path}: a YAML document with sha256 needs exactly one oci/file/http "
                                 f"url to know which digest it takes (found {sorted(schemes) or 'none'})")
            want = expected_sha(schemes.pop(), image_digest, module_sha)

            def repl(m):
                if m.group("value") != want:
                    line = line_base + piece.count("\n", 0, m.start()) + 1
                    changes.append((line, m.group("value"), want))
                return f"{m.group('lead')}{m.group('q')}{want}{m.group('q')}{m.group('tail')}"

            piece = SHA_LINE.sub(repl, piece)
        out.append(piece)
        line_base += piece.count("\n")
    return "".join(out), changes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wasm", type=Path, help="the built module, e.g. target/wasm32-wasip1/release/kvgate.wasm")
    p.add_argument("--out", type=Path, default=ROOT / "target/oci/kvgate", help="layout directory (default: %(default)s)")
    p.add_argument("--tag", default=None, help="ref name recorded in index.json (default: the crate version)")
    p.add_argument("--stamp", nargs="+", type=Path, default=[], metavar="YAML", help="rewrite sha256 values in these manifests")
    p.add_argument("--check", nargs="+", type=Path, default=[], metavar="YAML", help="fail if these manifests' sha256 values are stale")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)

    module = args.wasm.read_bytes()
    tag = args.tag or cargo_version()
    blobs, index, image_digest = build_image(module, tag)
    module_sha = sha256(module)
    if not args.check:
        write_layout(args.out, blobs, index)

    stale = []
    for path in args.stamp + args.check:
        text = path.read_text()
        new, changes = stamp_text(text, image_digest, module_sha, str(path))
        if path in args.check:
            stale += [(path, *c) for c in changes]
        elif new != text:
            path.write_text(new)
        for line, old, want in changes:
            verb = "stale" if path in args.check else "stamped"
            print(f"{path}:{line}: {verb} sha256 {old or '(empty)'} -> {want}", file=sys.stderr)

    result = {
        "layout": None if args.check else str(args.out),
        "tag": tag,
        "manifestDigest": "sha256:" + image_digest,
        "moduleSha256": module_sha,
        "moduleBytes": len(module),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        if result["layout"]:
            print(f"layout:          {result['layout']} (tag {tag})")
        print(f"manifest digest: sha256:{image_digest}   (WasmPlugin sha256 for oci:// urls)")
        print(f"module sha256:   {module_sha}   (sha256 for http(s):// urls; file:// is not checked)")
    if stale:
        print(f"{len(stale)} stale sha256 value(s): run ./build.sh oci", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
