package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestModelGroupsAndDeployments(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)

	g := root.okJSON("model-group", "create", "qwen-30b", "--description", "Qwen3 30B")
	require.Equal(t, "qwen-30b", g["name"])
	require.Contains(t, root.ok("mg", "list"), "qwen-30b")
	require.Equal(t, "Qwen3 30B A3B", root.okJSON("model-group", "update", "qwen-30b", "--description", "Qwen3 30B A3B")["description"])
	up := root.okJSON("model-group", "update", "qwen-30b", "--strategy", "affinity", "--session-ttl", "2h", "--load-factor", "2")
	require.Equal(t, map[string]any{"strategy": "affinity", "session_ttl": "7200s", "load_factor": 2.0}, up["routing"])
	up = root.okJSON("model-group", "update", "qwen-30b", "--strategy", "engine_load", "--clear", "session-ttl", "--clear", "load-factor")
	require.Equal(t, map[string]any{"strategy": "engine_load"}, up["routing"])
	require.Contains(t, root.fail("model-group", "update", "qwen-30b", "--strategy", "fastest"), "routing.strategy")
	require.Contains(t, root.fail("model-group", "create", "other", "--strategy", "least_outstanding", "--session-ttl", "1h"), "routing.session_ttl")
	g = root.okJSON("model-group", "create", "batchy", "--strategy", "weighted_shuffle")
	require.Equal(t, map[string]any{"strategy": "weighted_shuffle"}, g["routing"])
	require.Contains(t, root.ok("model-group", "delete", "batchy"), "Deleted model group batchy")

	const secret = "sk-upstream-cli-secret"
	credFile := filepath.Join(t.TempDir(), "cred")
	require.NoError(t, os.WriteFile(credFile, []byte(secret+"\n"), 0o600))
	out := root.ok("deployment", "create", "--model-group", "qwen-30b", "--api-base", "http://vllm-a:8000/v1",
		"--upstream-model", "Qwen/Qwen3-30B-A3B", "--credential-file", credFile, "--input-price", "0.0000002",
		"--output-price", "0.0000008", "--tools", "--max-input-tokens", "32768", "--tags", "interactive,gpu:h100", "-o", "json")
	require.NotContains(t, out, secret, "the credential is never printed")
	var dep map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &dep))
	id := dep["id"].(string)
	require.Equal(t, true, dep["has_credential"])
	require.Equal(t, 1.0, dep["weight"])
	require.Equal(t, map[string]any{"tools": true, "max_input_tokens": "32768"}, dep["capabilities"])
	require.Equal(t, []any{"interactive", "gpu:h100"}, dep["tags"])

	// Without prices (and not free) the API refuses, naming the field.
	require.Contains(t, root.fail("deployment", "create", "--model-group", "qwen-30b", "--api-base", "http://vllm-b:8000/v1",
		"--upstream-model", "m"), "prices: required")
	free := root.okJSON("deployment", "create", "--model-group", "qwen-30b", "--api-base", "http://vllm-b:8000/v1",
		"--upstream-model", "m", "--free")
	require.Equal(t, true, free["free"])

	up = root.okJSON("deployment", "update", id, "--weight", "5", "--output-price", "0.000001", "--tools=false", "--clear", "tags")
	require.Equal(t, 5.0, up["weight"])
	require.Equal(t, map[string]any{"input_per_token": 2e-7, "output_per_token": 1e-6}, up["prices"])
	require.Equal(t, map[string]any{"max_input_tokens": "32768"}, up["capabilities"])
	require.Nil(t, up["tags"])
	require.Equal(t, true, up["has_credential"], "fields outside the mask are kept")

	up = root.okJSON("deployment", "update", id, "--remove-credential")
	require.Nil(t, up["has_credential"])
	up = root.with("UPSTREAM_KEY=sk-from-env").okJSON("deployment", "update", id, "--credential-env", "UPSTREAM_KEY", "--max-concurrency", "8")
	require.Equal(t, true, up["has_credential"])
	require.Equal(t, "8", up["max_concurrency"])
	require.Contains(t, root.with("UPSTREAM_KEY=x").fail("deployment", "update", id, "--credential-env", "UPSTREAM_KEY", "--remove-credential"), "not both")

	table := root.ok("deployment", "list", "--model-group", "qwen-30b")
	require.Contains(t, table, id)
	require.Contains(t, table, "$0.2/$1")
	require.Contains(t, table, "free")
	require.Contains(t, root.ok("deployment", "get", id), "has_credential:")

	require.Contains(t, root.fail("model-group", "delete", "qwen-30b"), "failed_precondition")
	require.Contains(t, root.ok("deployment", "delete", id), "Deleted deployment "+id)
	require.Contains(t, root.ok("deployment", "delete", free["id"].(string)), "Deleted deployment")
	require.Contains(t, root.ok("model-group", "delete", "qwen-30b"), "Deleted model group qwen-30b")
	require.Contains(t, root.fail("model-group", "get", "qwen-30b"), "not_found")
}
