"""entrypoints: the front doors, where users come in.

    cli.py    the command table: ``python -m minipaged chat | generate | fetch | bench``
    args.py   the engine and sampling flags every command shares (vLLM's names), turned into
              LLMEngine keyword arguments and SamplingParams
    chat.py   the interactive chat loop: streams each answer, trims old turns to fit

The Python API's front door is ``minipaged.LLM`` (engine/llm.py). Entry points call the
engine and the tools below them; nothing below imports them.
"""
