"""The public surface of loong_agentflow is deliberate: adding or removing a name updates this list."""

import loong_agentflow


def test_exports_are_pinned():
    assert sorted(loong_agentflow.__all__) == [
        "Agent",
        "AgentProgram",
        "BlackBoxRunner",
        "ChatML",
        "ChatMLRenderer",
        "ChatRenderer",
        "EnvAgent",
        "Environment",
        "Episode",
        "EpisodeLimits",
        "EpisodeSpec",
        "GymTextEnv",
        "HFChatRenderer",
        "Latency",
        "ProxyConfig",
        "ProxyServer",
        "ProxySession",
        "Reward",
        "SGLangClientConfig",
        "SGLangEngine",
        "SGLangError",
        "Sandbox",
        "SandboxLimits",
        "SandboxResult",
        "SandboxUnavailable",
        "ScriptedEpisode",
        "SkyRLTextEnv",
        "StepResult",
        "TemplateChat",
        "TextCodec",
        "TokenBuffer",
        "Tool",
        "ToolAgent",
        "ToolCall",
        "ToolRegistry",
        "ToolResult",
        "bash_tool",
        "chat_format",
        "function_tool",
        "parse_tool_calls",
        "python_tool",
        "run_episodes",
    ]


def test_every_export_resolves():
    for name in loong_agentflow.__all__:
        assert getattr(loong_agentflow, name) is not None, name
