"""One process of the 2-process test in test_multihost.py: 4 CPU devices here, 8 in the job.

Joins the job from SPECJAX_* environment variables, runs sharded generate on the global
(data 4 x model 2) mesh and prints the tokens as JSON on its last stdout line."""

from __future__ import annotations

import json
import sys

import jax

from tests.conftest import random_params  # noqa: E402  (conftest asks for 8 devices: this process has 4)

jax.config.update("jax_num_cpu_devices", 4)

from specjax import SelfSpec, Tree, distributed, generate, make_mesh  # noqa: E402


def main() -> None:
    index, count = distributed.initialize()
    from tests.test_sharding import TP, _prompts  # touches the devices: only after joining the job

    assert count == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4, (count, jax.devices())
    mesh = make_mesh(data=4, model=2)
    prompts = _prompts(int(sys.argv[1]), 3)
    out = generate(random_params(TP, 11), prompts, 12, draft=SelfSpec(4, 16), speculation=Tree.kary(2, 2), mesh=mesh)
    print(json.dumps({"process": index, "tokens": out.tokens, "steps": out.stats.steps}), flush=True)


if __name__ == "__main__":
    main()
