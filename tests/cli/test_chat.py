"""`nanovllm chat` through its standard input: replies stream, /commands are handled (never
sent to the model), Ctrl-C stops a reply and the chat goes on."""

import signal
import subprocess
import sys

from tests.cli.process import finish, read_until, start_cli


def test_cli_chat_streams_and_exits(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm", "chat", "--model", str(tiny_llama), "--device", "cpu",
         "--max-tokens", "5", "--ignore-eos"],
        input="hello there\n/reset\nagain\n/exit\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 3


def test_commands_and_ctrl_c_during_a_reply(tiny_llama):
    proc = start_cli("chat", "--model", str(tiny_llama), "--device", "cpu", "--ignore-eos",
                     "--max-tokens", "400")
    proc.stdin.write(b"/help\n/foo\n/reset\n/system Be terse.\n/system\n//etc\n")
    proc.stdin.flush()
    shown = read_until(proc.stdout, b"Be terse.\n> ")  # every command answered, nothing sent
    shown += read_until(proc.stdout)  # "//etc" sent "/etc": its reply is under way
    proc.send_signal(signal.SIGINT)
    proc.stdin.write(b"/quit\n")
    proc.stdin.flush()
    status, out, err = finish(proc)
    shown = shown.decode(errors="replace") + out
    assert status == 0 and "Traceback" not in err, err
    for command in ("/help", "/reset", "/system TEXT", "/exit, /quit"):
        assert command in shown, shown
    assert "(new conversation)" in shown and "(system prompt set)" in shown
    assert err == "error: unknown command /foo; /help lists the commands\n"
    assert shown.endswith("\n> "), shown  # the stopped reply ended its line; a new prompt
