package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestExplainCommand drives `sluicectl explain` against the built `sluice
// control` and `sluice proxy`: unavailable without a proxy, then the
// proxy's trace by key id and by a token read from the environment
// (never printed), in the human table and in JSON, and flag errors.
func TestExplainCommand(t *testing.T) {
	t.Parallel()
	server, _, natsURL := startServerNATS(t)
	env := newCLIEnv(t)
	root := env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	org := root.okJSON("org", "create", "explain")["id"].(string)
	team := root.okJSON("team", "create", "agents", "--org", org)["id"].(string)
	root.ok("model-group", "create", "chat", "--platform-wide")
	root.ok("model-group", "create", "small", "--platform-wide")
	root.ok("deployment", "create", "--model-group", "chat", "--api-base", "http://vllm-a:8000/v1", "--upstream-model", "m", "--free", "--tools")
	root.ok("deployment", "create", "--model-group", "chat", "--api-base", "http://vllm-b:8000/v1", "--upstream-model", "m", "--free")
	root.ok("deployment", "create", "--model-group", "small", "--api-base", "http://vllm-c:8000/v1", "--upstream-model", "m", "--free")
	r := root.run("-o", "json", "key", "create", "--org", org, "--team", team, "--model-group-alias", "gpt-4o=chat")
	require.Equal(t, 0, r.code, r.stderr)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &created))
	keyID := obj(t, created, "key")["id"].(string)
	tok := created["token"].(string)

	// No data plane yet: a clear unavailable.
	require.Contains(t, root.fail("explain", "--key", keyID, "--model", "chat"), "no data plane of region default")

	startProxy(t, natsURL, "default", "dp-explain", "--redis-key-prefix", "sluicectl-explain-"+keyID+":")
	var out string
	deadline := time.Now().Add(20 * time.Second)
	for {
		// The proxy may be ready with a snapshot from before the key:
		// not_found until the key's event arrives.
		r := root.run("explain", "--key", keyID, "--model", "gpt-4o", "--tools", "-H", "User-Agent: cli-test/1")
		out = r.stdout + r.stderr
		if (r.code == 0 && strings.Contains(out, "Answer:      200")) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	require.Contains(t, out, "Answer:      200")
	require.Contains(t, out, "Model:       gpt-4o -> group chat (alias of the key)")
	require.Contains(t, out, "Class:       interactive (default)")
	require.Contains(t, out, "capabilities")
	require.Contains(t, out, "1. dep_")

	// By token from the environment, in JSON: the token is never printed.
	j := root.with("MY_KEY="+tok).okJSON("explain", "--token-env", "MY_KEY", "--model", "small", "--prompt-bytes", "400")
	trace := obj(t, j, "trace")
	require.Equal(t, keyID, obj(t, trace, "auth")["key_id"])
	require.Equal(t, "virtual_key", obj(t, trace, "auth")["method"])
	require.Equal(t, "small", obj(t, trace, "model")["group"])
	raw := root.with("MY_KEY="+tok).ok("explain", "--token-env", "MY_KEY", "--model", "small", "-o", "yaml")
	require.NotContains(t, raw, tok)

	// Refusals are explained, not errors.
	out = root.ok("explain", "--key", keyID, "--model", "nope")
	require.Contains(t, out, "Answer:      404 model_not_found at resolve")

	require.Contains(t, root.fail("explain", "--model", "chat"), "name the credential")
	require.Contains(t, root.fail("explain", "--key", keyID, "--model", "chat", "-H", "no-colon"), "Name: value")
	require.Contains(t, root.fail("explain", "--key", keyID, "--model", "chat", "-H", "Authorization: Bearer x"), "query.headers[Authorization]")
	require.Contains(t, root.fail("explain", "--token-env", "UNSET_VAR", "--model", "chat"), "$UNSET_VAR is empty")
}

// TestExplainTablePrefill: the human table shows each deployment's
// fleet-wide prefill in flight over its prefill cap, and a candidate the cap
// would skip.
func TestExplainTablePrefill(t *testing.T) {
	t.Parallel()
	pt, none := int64(700), int64(0)
	var b strings.Builder
	printTrace(&b, &configv1.ExplainTrace{
		Outcome: &configv1.ExplainOutcome{Status: 200},
		Deployments: []*configv1.ExplainDeployment{
			{Id: "d-capped", Candidate: true, PrefillTokensInFlight: &pt, MaxPrefillTokensInFlight: 1000, PrefillEstimate: 500, PrefillCapped: true},
			{Id: "d-free", Candidate: true, PrefillTokensInFlight: &none},
			{Id: "d-local", Candidate: true},
		},
		Routing: &configv1.ExplainRouting{Order: []string{"d-free"}},
	})
	out := b.String()
	require.Contains(t, out, "PREFILL IN FLIGHT")
	line := func(id string) string {
		for l := range strings.SplitSeq(out, "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), id+" ") {
				return l
			}
		}
		t.Fatalf("no row %s in\n%s", id, out)
		return ""
	}
	require.Contains(t, line("d-capped"), "700/1000 (+500: skipped, prefill cap)")
	require.Contains(t, line("d-free"), "0/-")
	require.NotContains(t, line("d-local"), "/")
}
