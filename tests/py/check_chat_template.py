"""Check that an exported model's tokenizer_config.json renders conversations as nemo-dag does.

Usage: python check_chat_template.py HF_DIR CASES_JSON [--transformers]

CASES_JSON is a list of {"messages", "tools", "add_generation_prompt", "enable_thinking",
"expected"}: a conversation and the text nemo-dag's renderer made of it (what `pack` trains
on). The chat template is read from HF_DIR/tokenizer_config.json alone and rendered the way
transformers' `apply_chat_template(tokenize=False)` renders it
(transformers/utils/chat_template_utils.py: a sandboxed jinja2 environment with trim_blocks,
lstrip_blocks and loop controls, `tojson` as json.dumps with ensure_ascii=False, the keyword
arguments as top-level variables). With `--transformers`, transformers itself does it:
`AutoTokenizer.from_pretrained(HF_DIR).apply_chat_template`. Exits 1 on the first case whose
text differs, printing both.
"""

import json
import sys
from pathlib import Path


def jinja_render(template, case):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=case["messages"],
        tools=case["tools"],
        add_generation_prompt=case["add_generation_prompt"],
        enable_thinking=case["enable_thinking"],
    )


def main():
    hf_dir, cases_path = sys.argv[1], sys.argv[2]
    cases = json.loads(Path(cases_path).read_text())
    if "--transformers" in sys.argv[3:]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)

        def render(case):
            return tokenizer.apply_chat_template(
                case["messages"],
                tools=case["tools"],
                add_generation_prompt=case["add_generation_prompt"],
                enable_thinking=case["enable_thinking"],
                tokenize=False,
            )

        way = "transformers"
    else:
        config = json.loads((Path(hf_dir) / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if not isinstance(template, str):
            print("tokenizer_config.json has no chat_template")
            return 1

        def render(case):
            return jinja_render(template, case)

        way = "jinja2"
    for i, case in enumerate(cases):
        got = render(case)
        if got != case["expected"]:
            print(f"case {i}: {way} renders\n{got!r}\nnemo-dag renders\n{case['expected']!r}")
            return 1
    print(f"{way}: {len(cases)} conversations rendered as nemo-dag renders them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
