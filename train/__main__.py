"""python -m train --config configs/tiny_cpu.yaml [--set section.key=value ...] [--fresh]"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    parser.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory and start over")
    parser.add_argument("--coordinator", help="multi-host: coordinator address host:port")
    parser.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, help="multi-host: this process's id")
    args = parser.parse_args(argv)

    from jtopoep.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    import jax

    from jtopoep import xla_cpu

    xla_cpu.configure()  # XLA:CPU settings for the planners' small kernels (no effect on GPU/TPU)
    processes = args.num_processes or 1
    # Without accelerators, the mesh's devices are emulated on the CPU, each process its share.
    xla_cpu.emulate_cpu_devices(max(config.topology.num_devices // processes, 1))
    if args.coordinator:
        # Collectives between CPU processes (emulated multi-host runs) go over Gloo; GPU and TPU
        # backends use their own.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    try:
        config.check_devices(jax.device_count())
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    from train.loop import Trainer

    last = Trainer(config, fresh=args.fresh).run()
    if jax.process_index() == 0 and last:
        print(f"done: step {last['step']} loss {last['loss']:.4f} eval {last.get('eval_loss', float('nan')):.4f} "
              f"-> {config.train.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
