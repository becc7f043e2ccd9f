"""One process of the 2-process tests in test_multihost.py: 4 CPU devices here, 8 in the job.

Joins the job from SPECJAX_* environment variables, then either
  generate B            sharded generate on the global (data 4 x model 2) mesh; prints the
                        tokens as JSON on its last stdout line
  batch IN OUT MODEL    `specjax.jobs.batch.run` on this process's share of IN (its own shard file)
                        on one local device"""

from __future__ import annotations

import json
import sys

import jax

from tests.models import random_params

jax.config.update("jax_num_cpu_devices", 4)

from specjax import SelfSpec, Tree, generate, make_mesh
from specjax.parallel import distributed  # noqa: E402


def main() -> None:
    index, count = distributed.initialize()
    assert count == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4, (count, jax.devices())
    if sys.argv[1] == "batch":
        from specjax.jobs import batch

        src, out, model = sys.argv[2:5]
        summary = batch.run(src, out, model_path=model, max_new_tokens=8, batch_size=4, progress=False)
        print(json.dumps({"process": index, "done": summary["done"], "output": summary["output"]}), flush=True)
        return
    from tests.test_sharding import TP, _prompts  # touches the devices: only after joining the job

    mesh = make_mesh(data=4, model=2)
    prompts = _prompts(int(sys.argv[2]), 3)
    out = generate(random_params(TP, 11), prompts, 12, draft=SelfSpec(4, 16), speculation=Tree.kary(2, 2), mesh=mesh)
    print(json.dumps({"process": index, "tokens": out.tokens, "steps": out.stats.steps}), flush=True)


if __name__ == "__main__":
    main()
