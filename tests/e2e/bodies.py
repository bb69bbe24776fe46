"""Request bodies the end-to-end tests send, in one place: each builder says what its prompts
share (or do not), since that is what routing, admission and the budget react to."""

import json

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

def tagged_completion(tag, words=60, max_tokens=16):
    """A completion whose text starts with `tag` (so distinct tags share no prefix blocks)."""
    return {"model": MODEL, "prompt": f"{tag} " + " ".join(f"w{i % 97}" for i in range(words)),
            "max_tokens": max_tokens}


def tagged_chat(tag, question="hello", max_tokens=8):
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": f"[{tag}] " + "shared context " * 120},
                         {"role": "user", "content": question}]}


def unshared_completion(i, prompt_words=350, max_tokens=300):
    # Distinct first words: no prefix sharing, each request's KV is its own.
    return {"model": MODEL, "prompt": f"req{i} " + "lorem ipsum dolor " * (prompt_words // 3),
            "max_tokens": max_tokens}


WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()


def unshared_chat(i, max_tokens, words=300):
    # A distinct first word: no two requests share a prefix, each one's KV is its own.
    text = f"question {i}: " + " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(words))
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def group_system_prompt(group, words=1500):
    # Distinct from the first character, so groups share no blocks.
    return f"[group {group}] " + " ".join(f"policy{(group * 7919 + i) % 1000} clause{i}" for i in range(words // 2))


def group_chat(group, question, max_tokens=8):
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": group_system_prompt(group)},
                         {"role": "user", "content": f"Question {question}: what does clause {question} mean?"}]}


def grouped_chat(group, i, max_tokens, system_words=1500, question_words=150):
    """Common English words (about one token each, so estimates are right from the start): a
    system prompt that group's requests share, then a question of request `i`'s own."""
    system = f"[group {group}] " + " ".join(WORDS[(group * 11 + j * 17) % len(WORDS)] for j in range(system_words))
    question = f"question {i}: " + " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(question_words))
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def chat_bytes(**kw):
    return json.dumps(dict({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, **kw)).encode()


def group_ids(group, i, shared=1000, own=40):
    """A prompt of token ids: `shared` ids its group's prompts all open with, then `own` of its own."""
    return [1000 + (group * 7919 + j * 31) % 100_000 for j in range(shared)] + \
        [2000 + (i * 104_729 + j * 13) % 100_000 for j in range(own)]
