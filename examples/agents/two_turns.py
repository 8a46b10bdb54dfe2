"""A two-turn environment for `--train.agent_func_path` (upstream's MultiTurnAgentExecutor, OpenRLHF 0.11.2).

The model answers the prompt; the environment appends an observation and asks again; the second answer is rewarded
(1 or 0) and the environment closes the episode with a last observation. Each rollout's action mask then has two
action spans, the model's turns, separated by the environment's tokens, and ends with environment tokens. The CPU
smoke's condition `agent_salt_geoalign` (examples/scripts/smoke_cpu.py) trains on it with SALT and GeoAlign.

    openrlhf-geo train-ppo-ray --train.agent_func_path examples/agents/two_turns.py ...

Each turn is capped at TURN_TOKENS tokens: upstream gives every turn the whole budget left of --data.max_len, which a
model that rarely samples its end-of-text token (the smoke's random tiny model) spends in its first turn, leaving no
room for a second.
"""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 2
TURN_TOKENS = 8
ASK_AGAIN = " Are you sure? A:"
CLOSE = " Noted."


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn == TURNS
        # the last answer's reward, binary and roughly balanced for a random model (as the smoke's reward_func)
        reward = torch.tensor(float(sum(map(ord, states["action_text"])) % 2) if done else 0.0)
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": CLOSE if done else ASK_AGAIN,
            "done": done,
            "extra_logs": {"agent_turns": float(self.turn)},
        }


class _TurnCap:
    """The vLLM engine as the executor calls it, each turn's max_tokens capped at TURN_TOKENS."""

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, prompt_token_ids, sampling_params, **kwargs):
        sampling_params.max_tokens = min(sampling_params.max_tokens, TURN_TOKENS)  # the executor's own copy
        return await self.engine.generate(prompt_token_ids, sampling_params, **kwargs)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        return await super().execute(
            prompt, label, sampling_params, max_length, hf_tokenizer, _TurnCap(llm_engine), images
        )
