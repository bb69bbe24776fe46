// Runs examples/request_cost compiled to wasm32-wasip1 in Node's V8 — the engine Envoy runs
// kvgate in — so that its per-request figures (and, with `node --cpu-prof`, where the time goes
// by wasm function) are V8's rather than native code's. Called by scripts/wasm_request_cost.sh:
//
//   node scripts/wasm_request_cost.mjs request_cost.wasm [request_cost's arguments...]
//
// The example runs on the in-memory host, so no proxy-wasm host function is ever called; the
// library's proxy-wasm exports still import them, and each is given a stub that fails loudly.
import { readFile } from "node:fs/promises";
import { argv, env, exit } from "node:process";
import { WASI } from "node:wasi";

const [wasmPath, ...args] = argv.slice(2);
const wasi = new WASI({ version: "preview1", args: ["request_cost", ...args], env, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(wasmPath));
const imports = { wasi_snapshot_preview1: wasi.wasiImport };
for (const { module: from, name, kind } of WebAssembly.Module.imports(module)) {
  if (from === "wasi_snapshot_preview1" || kind !== "function") continue;
  (imports[from] ??= {})[name] = () => {
    throw new Error(`${from}.${name} called outside Envoy`);
  };
}
const { exports } = await WebAssembly.instantiate(module, imports);
// The library's proxy-wasm shell also exports `_initialize` (a reactor's entry), which Node's
// WASI refuses beside `_start`: it is handed the command's two exports alone.
exit(wasi.start({ exports: { _start: exports._start, memory: exports.memory } }));
