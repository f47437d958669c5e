"""python -m train --config configs/tiny_cpu.yaml [--set section.key=value ...] [--fresh]

Exit status: 0 done, 1 the run failed (a non-finite loss, a receive buffer overflow, a checkpoint
that could not be written), 2 bad input (config, data, run folder), 128 + N stopped by signal N
after checkpointing. Errors are one line; --debug shows the traceback.
"""

import argparse
import os
import sys
import threading
import warnings


class DistributedError(RuntimeError):
    """The processes of a multi-process run could not all be reached."""


def _one_line_warnings(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value; repeatable")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the run folder (only a jtopoep run folder) and start over")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--coordinator", help="multi-process: the coordinator's address, host:port")
    parser.add_argument("--num-processes", type=int, help="multi-process: number of processes")
    parser.add_argument("--process-id", type=int, help="multi-process: this process's id, from 0")
    parser.add_argument("--connect-timeout", type=int, default=120, metavar="SECONDS",
                        help="multi-process: give up when not every process has joined after this long, "
                             "or has built its model this long after the first")
    parser.add_argument("--peer-timeout", type=int, default=300, metavar="SECONDS",
                        help="multi-process: stop when no step has finished for this long (a peer died)")
    args = parser.parse_args(argv)
    multi = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in multi) and not all(v is not None for v in multi):
        parser.error("a multi-process run needs all of --coordinator, --num-processes and --process-id")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id} must be in [0, --num-processes = {args.num_processes})")
    return args


def join(args) -> None:
    """Join the multi-process run, or stop with one line after --connect-timeout seconds. XLA's
    coordination client aborts the whole process when its own deadline passes, so a watchdog with
    the user's deadline ends the process first, cleanly (the client waits without holding the GIL)."""
    import jax

    message = (f"error: process {args.process_id} could not join the {args.num_processes}-process run at "
               f"{args.coordinator} within {args.connect_timeout} s: start every process, with the same "
               f"--coordinator and --num-processes and its own --process-id")

    def give_up():
        print(message, file=sys.stderr, flush=True)
        os._exit(1)

    watchdog = threading.Timer(args.connect_timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        # XLA's own deadlines abort the process; the watchdogs here end it first, with one line.
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=args.connect_timeout + 60,
                                   heartbeat_timeout_seconds=args.peer_timeout + 60)
    except Exception as err:
        raise DistributedError(f"{message[len('error: '):]} ({' '.join(str(err).split())[:300]})") from err
    finally:
        watchdog.cancel()


def train(args) -> int:
    from jtopoep.config import load_config

    config = load_config(args.config, args.overrides)
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
        join(args)
    config.check_devices(jax.device_count())

    from train.loop import Trainer

    last = Trainer(config, fresh=args.fresh, peer_timeout=args.peer_timeout, start_timeout=args.connect_timeout).run()
    if jax.process_index() == 0 and last:
        evaluated = f" eval {last['eval_loss']:.4f}" if "eval_loss" in last else ""
        print(f"done: step {last['step']} loss {last['loss']:.4f}{evaluated} -> {config.train.run_dir}", flush=True)
    if args.coordinator:
        # Every process has passed the run's last barrier (Trainer.run): leave JAX's distributed
        # system together now. Left to interpreter exit, its shutdown barrier runs after the other
        # exit handlers, which only process 0 has many of (the report's, the checkpointer's), and a
        # slow exit there has aborted the other process at that barrier's deadline.
        jax.distributed.shutdown()
    return 0


SUPERVISED = "JTOPOEP_SUPERVISED"


def _die_with_parent() -> None:
    """In the supervised child (Linux): SIGKILL when the supervisor dies, as a killed process would."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def supervise(argv: list[str], args) -> int:
    """Run this command as a child and watch it. A process of a multi-process run whose peer dies
    can be aborted inside a collective by the transport (Gloo, NCCL) with a message of its own; the
    supervisor then ends the run with one line that says what happened."""
    import signal
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "train", *argv], env={**os.environ, SUPERVISED: "1"},
                             preexec_fn=_die_with_parent)
    # SIGTERM (a scheduler's, sent to this process) goes on to the child. Ctrl-C reaches the child
    # from the terminal itself, with the rest of the process group: passed on, it would arrive twice,
    # and a second one stops the trainer without its checkpoint.
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum)),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    try:
        status = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if status >= 0:
        return status
    name = signal.Signals(-status).name
    print(f"\nerror: process {args.process_id} of the {args.num_processes}-process run was ended by {name}, most "
          f"likely in a collective whose peer died or stopped answering; rerun every process to resume from "
          f"the last checkpoint", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.num_processes and not os.environ.get(SUPERVISED):
        return supervise(argv, args)
    warnings.showwarning = _one_line_warnings
    from train.signals import Interrupted

    try:
        return train(args)
    except Interrupted as stop:
        print(stop, file=sys.stderr)
        return 128 + stop.signum
    except Exception as err:
        # Bad input the user can fix (2), or a run that stopped on its numbers, disk or peers (1).
        from jtopoep.config import ConfigError
        from train.checkpoint import CheckpointError
        from train.data import DataError
        from train.loop import NonFiniteLossError, PlanMismatchError, ReceiveCapacityError
        from train.run_folder import RunFolderError

        status = (2 if isinstance(err, (ConfigError, DataError, RunFolderError)) else
                  1 if isinstance(err, (NonFiniteLossError, ReceiveCapacityError, CheckpointError,
                                        PlanMismatchError, DistributedError)) else None)
        if args.debug or status is None:
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
