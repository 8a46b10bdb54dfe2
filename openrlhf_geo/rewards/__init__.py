"""Reward functions (math-verify, ArmoRM) and reward-noise injection for robustness experiments."""

# A coincidental overlap shorter than this is not evidence of where the prompt ends.
_MIN_PROMPT_OVERLAP = 16


def _suffix_prefix_overlap(prompt, query):
    """Length of the longest prefix of ``query`` that is a suffix of ``prompt`` (KMP prefix function)."""
    s = [*query[: len(prompt)], None, *prompt]  # None: a separator no character equals
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + 1 if s[i] == s[k] else k
    return pi[-1]


def split_query(query, prompt):
    """Response text of an OpenRLHF query (the decoded prompt + response tokens) given the prompt string.

    ``query[len(prompt):]`` when the query starts with the prompt. Upstream left-truncates a prompt longer than
    its budget, so otherwise the query starts with a suffix of the prompt: the longest one is cut off. Raises
    ValueError when no such overlap exists, rather than scoring prompt text as if it were the response.
    """
    if query.startswith(prompt):
        return query[len(prompt) :]
    overlap = _suffix_prefix_overlap(prompt, query)
    if overlap < min(len(prompt), _MIN_PROMPT_OVERLAP):
        raise ValueError(
            f"cannot locate the prompt inside the query (prompt ends with {prompt[-60:]!r}; query starts with "
            f"{query[:60]!r}): the reward needs upstream's (query, prompt) pairs unchanged"
        )
    return query[overlap:]
