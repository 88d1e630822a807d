"""ChatSession: the interactive ``python -m minipaged chat`` loop, streaming each answer.

Every turn re-renders the whole conversation through the model's chat template
and submits it as one request; tokens are printed as the engine produces them
(DELTA outputs). Works with a terminal or with piped stdin (one message a line).
"""

from __future__ import annotations

import argparse
import itertools
import sys

from ..engine.llm_engine import LLMEngine
from ..sampling_params import OutputKind
from .args import engine_kwargs, sampling_params

HELP = "commands: /reset (forget the conversation), /stats (engine numbers), /exit (or Ctrl-D)"


def format_stats(stats: dict) -> str:
    return (f"running {stats['num_running']}, waiting {stats['num_waiting']}, "
            f"KV blocks {stats['kv_blocks_used']}/{stats['kv_blocks_total']} "
            f"(peak {stats['kv_blocks_peak']}, usage {stats['kv_usage']:.1%}), "
            f"preemptions {stats['num_preemptions']} (swap {stats['num_preemptions_swap']}, "
            f"recompute {stats['num_preemptions_recompute']}), prompt tokens {stats['prompt_tokens']} "
            f"(prefix cache hit rate {stats['prefix_cache_hit_rate']:.0%}), "
            f"generated tokens {stats['generation_tokens']}")


class ChatSession:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # The sampling flags are checked before the (slow) load, as the engine flags are;
        # then every flag not given takes the model's recommendation (generation_config.json)
        # if it has one, else chat's own default (docs/configuration.md, "chat").
        self.params = sampling_params(args, output_kind=OutputKind.DELTA)
        self.engine = LLMEngine(**engine_kwargs(args))
        self.params = sampling_params(args, self.engine.generation_defaults, output_kind=OutputKind.DELTA)
        self.messages: list[dict] = []
        self.interactive = sys.stdin.isatty()
        self._ids = itertools.count()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def lines(self):
        """User messages: typed at a prompt, or one per line of piped input."""
        while True:
            try:
                line = input("> ") if self.interactive else sys.stdin.readline()
            except EOFError:  # Ctrl-D
                if self.interactive:
                    print()
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, keep going
                print()
                continue
            if not self.interactive and line == "":
                return  # end of the pipe
            yield line.strip()

    def run(self) -> int:
        if self.interactive:
            print(f"minipaged chat with {self.args.model}. {HELP}")
        for line in self.lines():
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                self.reset()
                print("(conversation cleared)")
                continue
            if line == "/stats":
                print(format_stats(self.engine.get_stats()))
                continue
            if line.startswith("/"):
                print(f"unknown command {line}; {HELP}")
                continue
            self.messages.append({"role": "user", "content": line})
            answer = self.answer()
            if answer is None:
                self.messages.pop()  # refused (too long): forget the message
            else:
                self.messages.append({"role": "assistant", "content": answer})
                if self.args.show_blocks:
                    print(self.pool_picture())
        return 0

    def pool_picture(self) -> str:
        """The KV pool after an answer: with prefix caching, the conversation's blocks stay
        in the page cache (free, but found again by the next turn)."""
        from ..tools.viz import engine_snapshot, render_text  # noqa: PLC0415

        return render_text(engine_snapshot(self.engine), max_blocks=32)

    def fitted_prompt(self) -> tuple[list[dict], list[int]]:
        """The conversation (oldest turns dropped if it would not fit) and its token ids."""
        tokenizer = self.engine.tokenizer
        room = self.engine.max_model_len - 1
        messages = list(self.messages)
        first_turn = 1 if messages and messages[0]["role"] == "system" else 0
        while True:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= room or len(messages) - first_turn <= 1:
                return messages, ids
            del messages[first_turn:first_turn + 2]  # oldest user + assistant pair

    def answer(self) -> str | None:
        request_id = f"chat-{next(self._ids)}"
        try:
            # The template checks the messages: a line that is not valid Unicode (a pipe
            # decoded with surrogateescape) is a ValueError there, a refused request a RequestError.
            messages, ids = self.fitted_prompt()
            self.engine.add_request(request_id, ids, self.params)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return None
        if len(messages) < len(self.messages):  # accepted: the trimmed history is the history now
            print("(oldest turns dropped to fit max_model_len)", file=sys.stderr)
            self.messages[:] = messages
        pieces = []
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    delta = out.outputs[0].text
                    pieces.append(delta)
                    print(delta, end="", flush=True)
        except KeyboardInterrupt:  # Ctrl-C: stop this answer, keep the program
            self.engine.abort_request(request_id)
            print(" [stopped]", end="")
        print(flush=True)
        return "".join(pieces)
