"""The `barqtrain` command line: commands, defaults and the errors a mistyped option gets."""

import pytest

from barqtrain import cli
from barqtrain_bench import command, e2e
from barqtrain_bench.op_cases import OP_BENCHMARKS


def parse(*argv):
    return cli.build_parser().parse_args(argv)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("train", "config", "export", "tokenize", "bench"))


def test_bench_comes_from_the_entry_point():
    assert command in cli.installed_commands()
    assert "bench" not in {module.__name__.rpartition(".")[2] for module in cli.COMMANDS}


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


def test_bench_defaults_run_every_suite_against_hf_liger_and_unsloth():
    args = parse("bench")
    assert args.suite == "all"
    assert args.compare == ("hf", "liger", "unsloth")
    assert args.models == ("llama-1b", "llama-8b")
    assert args.variants == (
        "barqtrain", "barqtrain+compile", "barqtrain+graph", "barqtrain-qlora", "barqtrain-ternary",
        "barqtrain-peft-precision", "barqtrain+attention",
    )
    assert not args.profile and args.tokenizer is None
    assert (args.steps, args.warmup) == (e2e.DEFAULT_STEPS, e2e.DEFAULT_WARMUP)
    assert str(args.out) == "bench_out"
    assert args.ops == tuple(OP_BENCHMARKS)
    assert not args.tiny


def test_bench_options_parse():
    args = parse(
        "bench", "e2e", "--compare", "liger", "--models", "llama-8b", "--steps", "4", "--warmup", "0", "--out", "x"
    )
    assert (args.suite, args.compare, args.models) == ("e2e", ("liger",), ("llama-8b",))
    assert (args.steps, args.warmup, str(args.out)) == (4, 0, "x")
    assert parse("bench", "ops", "--compare", "none").compare == ()
    assert parse("bench", "ops", "--compare", "hf,compile").compare == ("hf", "compile")
    assert parse("bench", "ops", "--ops", "rope, swiglu").ops == ("rope", "swiglu")


def test_bench_e2e_options_parse(tmp_path):
    args = parse(
        "bench", "e2e", "--models", "qwen2.5-1.5b,gemma2-2b", "--variants", "barqtrain-peft-precision",
        "--compare", "hf,unsloth", "--profile", "--tokenizer", str(tmp_path),
    )  # fmt: skip
    assert args.models == ("qwen2.5-1.5b", "gemma2-2b")
    assert args.variants == ("barqtrain-peft-precision",) and args.compare == ("hf", "unsloth")
    assert args.profile and args.tokenizer == tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--compare", "hf,deepspeed"], "unknown name(s) deepspeed"),
        (["bench", "--models", "llama-70b"], "unknown name(s) llama-70b"),
        (["bench", "ops", "--ops", "rms_norm,softmax"], "unknown name(s) softmax"),
        (["bench", "e2e", "--variants", "barqtrain,barqtrain-fp8"], "unknown name(s) barqtrain-fp8"),
        (["bench", "e2e", "--models", "tiny"], "unknown name(s) tiny"),
        (["bench", "e2e", "--tokenizer", "/nonexistent/tokenizer"], "no such directory: /nonexistent/tokenizer"),
        (["bench", "--steps", "0"], "must be at least 1"),
        (["bench", "--warmup", "two"], "expected an integer"),
        (["bench", "benchmarks"], "invalid choice"),
    ],
)
def test_bad_options_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_e2e_rejects_an_ops_only_baseline():
    with pytest.raises(SystemExit, match="applies to 'bench ops' only"):
        cli.main(["bench", "e2e", "--compare", "compile", "--tiny"])
