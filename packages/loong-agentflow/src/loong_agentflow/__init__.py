"""Loong AgentFlow: run agents against a policy and get token-exact training trajectories."""

from loong_agentflow.agent import (
    Agent,
    ChatML,
    Episode,
    EpisodeLimits,
    EpisodeSpec,
    Reward,
    ScriptedEpisode,
    ToolAgent,
    run_episodes,
)
from loong_agentflow.blackbox import AgentProgram, BlackBoxRunner
from loong_agentflow.chat_template import TemplateChat, chat_format
from loong_agentflow.env import EnvAgent, Environment, GymTextEnv, SkyRLTextEnv, StepResult
from loong_agentflow.proxy import ProxyConfig, ProxyServer
from loong_agentflow.proxy.render import ChatMLRenderer, ChatRenderer, HFChatRenderer
from loong_agentflow.proxy.session import ProxySession
from loong_agentflow.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    bash_tool,
    python_tool,
)
from loong_agentflow.sglang_client import SGLangClientConfig, SGLangEngine, SGLangError
from loong_agentflow.tokens import TextCodec, TokenBuffer
from loong_agentflow.tools import (
    Latency,
    Tool,
    ToolCall,
    ToolRegistry,
    ToolResult,
    function_tool,
    parse_tool_calls,
)

__all__ = [
    # white-box agents
    "Agent",
    "ChatML",
    "Episode",
    "EpisodeLimits",
    "EpisodeSpec",
    "Reward",
    "ScriptedEpisode",
    "TemplateChat",
    "ToolAgent",
    "chat_format",
    "run_episodes",
    # multi-turn environments
    "EnvAgent",
    "Environment",
    "GymTextEnv",
    "SkyRLTextEnv",
    "StepResult",
    # black-box agents (OpenAI-compatible proxy)
    "AgentProgram",
    "BlackBoxRunner",
    "ChatMLRenderer",
    "ChatRenderer",
    "HFChatRenderer",
    "ProxyConfig",
    "ProxyServer",
    "ProxySession",
    # transcript
    "TextCodec",
    "TokenBuffer",
    # tools
    "Latency",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "function_tool",
    "parse_tool_calls",
    # model-written code
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "bash_tool",
    "python_tool",
    # SGLang servers
    "SGLangClientConfig",
    "SGLangEngine",
    "SGLangError",
]
