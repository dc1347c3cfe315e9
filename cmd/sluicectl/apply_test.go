package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// applyFile is a platform in one file: two orgs, teams with limits and
// aliases, a user, two model groups with deployments (one credential by
// reference).
const applyFile = `kind: Org
name: acme
limits: {max_budget: 100, budget_duration: 30d}
metadata: {cost_center: "42"}
---
kind: Org
name: beta
---
kind: ModelGroup
name: qwen-30b
description: Qwen3 30B
routing: {strategy: affinity, session_ttl: 30m, load_factor: 1.5}
deployments:
  - api_base: http://vllm-a:8000/v1
    upstream_model: Qwen/Qwen3-30B
    prices: {input_per_token: 0.0000002, output_per_token: 0.0000008}
    capabilities: {tools: true, max_input_tokens: 32768}
    tags: [interactive]
    credential: {valueFrom: {env: UPSTREAM_KEY}}
  - api_base: http://vllm-b:8000/v1
    upstream_model: Qwen/Qwen3-30B
    weight: 3
    max_concurrency: 16
    free: true
---
kind: ModelGroup
name: old-model
deployments:
  - {api_base: "http://old:8000/v1", upstream_model: old, free: true}
---
kind: Team
org: acme
name: agents
traffic_class: agent
limits: {rpm_limit: 600, max_parallel_requests: 8, allowed_models: [qwen-30b]}
model_group_aliases: {qwen: qwen-30b}
---
kind: Team
org: acme
name: chat
---
kind: User
org: acme
email: Ada@Example.com
display_name: Ada
limits: {tpm_limit: 10000}
`

// runIn runs sluicectl with stdin.
func (e *cliEnv) runIn(stdin string, args ...string) result {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bins.sluicectl, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + e.home, "SLUICE_CONFIG=" + e.config}, e.extra...)
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatalf("run sluicectl %v: %v", args, err)
	}
	return result{stdout.String(), stderr.String(), code}
}

// auditCount is the number of audit events the platform token sees.
func auditCount(t *testing.T, e *cliEnv) int {
	t.Helper()
	var events []any
	require.NoError(t, json.Unmarshal([]byte(e.ok("audit", "list", "-o", "json")), &events))
	return len(events)
}

// planLines are the "+ X", "~ X" and "- X" lines of an apply output.
func planLines(out string) []string {
	var l []string
	for _, line := range strings.Split(out, "\n") {
		if regexp.MustCompile(`^[+~-] `).MatchString(line) {
			l = append(l, line)
		}
	}
	sort.Strings(l)
	return l
}

func TestApplyIsIdempotentPrunesAndRoundTrips(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	const secret = "sk-upstream-apply-secret"
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken, "UPSTREAM_KEY="+secret)
	dir := t.TempDir()
	file := filepath.Join(dir, "platform.yaml")
	require.NoError(t, os.WriteFile(file, []byte(applyFile), 0o600))

	// The dry run says what would happen and changes nothing.
	before := auditCount(t, root)
	dry := root.ok("apply", "-f", file, "--dry-run")
	require.Contains(t, dry, "Dry run: 10 to create, 0 to change, 0 to delete.")
	require.Contains(t, dry, "credential: from env UPSTREAM_KEY")
	require.NotContains(t, dry, secret)
	require.Equal(t, before, auditCount(t, root))

	out := root.ok("apply", "-f", file)
	require.Contains(t, out, "Applied: 10 to create, 0 to change, 0 to delete.")
	require.NotContains(t, out, secret)
	var deps []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("deployment", "list", "--model-group", "qwen-30b", "-o", "json")), &deps))
	require.Len(t, deps, 2)
	applied := auditCount(t, root)
	require.Greater(t, applied, before)

	// The second run changes nothing: no mutation, no audit row.
	again := root.ok("apply", "-f", file)
	require.Equal(t, "Applied: no changes.\n", again)
	require.Equal(t, applied, auditCount(t, root), "re-applying writes no audit row")

	// get -o yaml writes documents apply accepts, and applying them
	// changes nothing; credentials appear as "stored", never inline.
	var all strings.Builder
	for _, kind := range []string{"org", "model-group", "team", "user"} {
		y := root.ok("get", kind, "-o", "yaml")
		require.NotContains(t, y, secret)
		all.WriteString(y)
	}
	require.Contains(t, all.String(), "stored: true")
	r := root.runIn(all.String(), "apply", "-f", "-")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "Applied: no changes.\n", r.stdout)
	require.Equal(t, applied, auditCount(t, root))
	one := root.ok("get", "team", "agents", "--org", "acme")
	require.Contains(t, one, "traffic_class: agent")
	require.Contains(t, one, "max_parallel_requests: 8")
	mg := root.ok("get", "model-group", "qwen-30b")
	require.Contains(t, mg, "strategy: affinity")
	require.Contains(t, mg, "session_ttl: 30m0s")
	require.Contains(t, mg, "load_factor: 1.5")
	// A changed strategy is one update of the group.
	strat := strings.Replace(applyFile, "routing: {strategy: affinity, session_ttl: 30m, load_factor: 1.5}", "routing: {strategy: least_outstanding}", 1)
	require.NoError(t, os.WriteFile(file, []byte(strat), 0o600))
	out = root.ok("apply", "-f", file)
	require.Equal(t, []string{"~ ModelGroup qwen-30b"}, planLines(out))
	require.Contains(t, root.ok("get", "model-group", "qwen-30b"), "strategy: least_outstanding")
	require.NoError(t, os.WriteFile(file, []byte(applyFile), 0o600))
	require.Equal(t, []string{"~ ModelGroup qwen-30b"}, planLines(root.ok("apply", "-f", file)))
	applied += 2

	// A changed field is one update with its diff.
	changed := strings.Replace(applyFile, "rpm_limit: 600", "rpm_limit: 900", 1)
	require.NoError(t, os.WriteFile(file, []byte(changed), 0o600))
	out = root.ok("apply", "-f", file)
	require.Equal(t, []string{"~ Team acme/agents"}, planLines(out))
	require.Contains(t, out, "limits.rpm_limit: 600 → 900")
	require.Equal(t, applied+1, auditCount(t, root))

	// Prune removes exactly what the file dropped: an org, a team, a
	// user, a model group (with its deployment) and one deployment.
	pruned := changed
	for _, drop := range []string{"---\nkind: Org\nname: beta\n", "---\nkind: Team\norg: acme\nname: chat\n",
		"---\nkind: ModelGroup\nname: old-model\ndeployments:\n  - {api_base: \"http://old:8000/v1\", upstream_model: old, free: true}\n"} {
		require.Contains(t, pruned, drop)
		pruned = strings.Replace(pruned, drop, "", 1)
	}
	pruned = pruned[:strings.Index(pruned, "---\nkind: User")]
	pruned = strings.Replace(pruned, "  - api_base: http://vllm-b:8000/v1\n    upstream_model: Qwen/Qwen3-30B\n    weight: 3\n    max_concurrency: 16\n    free: true\n", "", 1)
	pruned += "---\nkind: User\norg: acme\nemail: grace@example.com\n"
	require.NoError(t, os.WriteFile(file, []byte(pruned), 0o600))
	require.Contains(t, root.fail("apply", "-f", file, "--prune"), "--yes")
	out = root.ok("apply", "-f", file, "--prune", "--yes")
	require.Equal(t, []string{
		"+ User acme/grace@example.com",
		"- Deployment old-model http://old:8000/v1 (old)",
		"- Deployment qwen-30b http://vllm-b:8000/v1 (Qwen/Qwen3-30B)",
		"- ModelGroup old-model",
		"- Org beta",
		"- Team acme/chat",
		"- User acme/ada@example.com",
	}, planLines(out))
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file, "--prune", "--yes"))
	require.NotContains(t, root.ok("org", "list"), "beta")
	require.NotContains(t, root.ok("mg", "list"), "old-model")
	require.Contains(t, root.ok("team", "list"), "agents")
	require.NotContains(t, root.ok("team", "list"), "chat")
}

func TestApplyRejectsUnknownFieldsAndInlineSecrets(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	for _, tc := range []struct{ doc, want string }{
		{"kind: Org\nname: a\n---\nkind: Team\norg: a\nname: t\nrpm: 5\n", "document 2: line 4: field rpm not found in Team"},
		{"kind: Team\norg: a\nname: t\nlimits: {rpm_limt: 5}\n", "document 1: line 4: field rpm_limt not found in Team"},
		{"kind: ModelGroup\nname: g\ndeployments:\n  - {api_base: x, upstream_model: m, credential: sk-inline}\n", "document 1:"},
		{"kind: ModelGroup\nname: g\ndeployments:\n  - {api_base: x, upstream_model: m, credential: {value: sk-inline}}\n", "field value not found"},
		{"kind: Gadget\nname: g\n", `unknown kind "Gadget"`},
		{"kind: Team\norg: nowhere\nname: t\n", `org "nowhere" does not exist and the file does not declare it`},
		{"kind: Org\nname: a\n---\nkind: Org\nname: a\n", "Org a is already declared in document 1"},
	} {
		r := root.runIn(tc.doc, "apply", "-f", "-", "--dry-run")
		require.NotEqual(t, 0, r.code, tc.doc)
		require.Contains(t, r.stderr, tc.want, tc.doc)
		require.NotContains(t, r.stderr+r.stdout, "sk-inline")
	}
}

// An org-scoped token applies its org's teams and users; prune never
// reaches another org.
func TestApplyWithAnOrgToken(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "acme")["id"].(string)
	otherID := root.okJSON("org", "create", "other")["id"].(string)
	root.ok("team", "create", "--org", otherID, "--name", "theirs")
	root.ok("team", "create", "--org", orgID, "--name", "stale")
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("token", "create", "--scope", "org", "--org", orgID, "--role", "editor", "--name", "acme-editor", "-o", "json")), &created))
	org := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+created["token"].(string))

	doc := "kind: Team\norg: acme\nname: agents\nlimits: {rpm_limit: 60}\n---\nkind: User\norg: acme\nemail: ada@example.com\n"
	r := org.runIn(doc, "apply", "-f", "-", "--prune", "--yes")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, []string{"+ Team acme/agents", "+ User acme/ada@example.com", "- Team acme/stale"}, planLines(r.stdout))
	r = org.runIn(doc, "apply", "-f", "-", "--prune", "--yes")
	require.Equal(t, "Applied: no changes.\n", r.stdout, r.stderr)
	require.Contains(t, root.ok("team", "list", "--org", otherID), "theirs")
	require.Contains(t, org.ok("get", "team"), "rpm_limit: 60")
}

// TestApplyDeploymentTraffic: a deployment's traffic settings (the
// prefill cap among them) are applied with it, created with a new
// deployment and updated on an existing one after its max_concurrency;
// re-applying changes nothing; a bad value is the admin API's
// InvalidArgument.
func TestApplyDeploymentTraffic(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	dir := t.TempDir()
	file := filepath.Join(dir, "fleet.yaml")
	doc := func(conc, reserve, prefill int) string {
		return `kind: ModelGroup
name: shared
platform_wide: true
deployments:
  - api_base: http://vllm-a:8000/v1
    upstream_model: m
    free: true
    max_concurrency: ` + strconv.Itoa(conc) + `
    traffic: {interactive_reserve: ` + strconv.Itoa(reserve) + `, max_prefill_tokens_in_flight: ` + strconv.Itoa(prefill) + `, priority_scheduling: true}
  - api_base: http://vllm-b:8000/v1
    upstream_model: m
    free: true
`
	}
	require.NoError(t, os.WriteFile(file, []byte(doc(8, 2, 8192)), 0o600))
	out := root.ok("apply", "-f", file)
	require.Contains(t, out, "traffic.max_prefill_tokens_in_flight: 8192")
	var deps []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("deployment", "list", "--model-group", "shared", "-o", "json")), &deps))
	require.Len(t, deps, 2)
	idOf := func(base string) string {
		for _, d := range deps {
			if d["api_base"] == base || d["apiBase"] == base {
				return d["id"].(string)
			}
		}
		t.Fatalf("no deployment %s in %v", base, deps)
		return ""
	}
	a := idOf("http://vllm-a:8000/v1")
	got := root.okJSON("traffic", "deployment", "get", a)
	require.EqualValues(t, 8192, toInt(t, firstOf(got, "max_prefill_tokens_in_flight", "maxPrefillTokensInFlight")))
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file))

	// A larger engine and cap: the deployment first, then its traffic.
	require.NoError(t, os.WriteFile(file, []byte(doc(16, 4, 16384)), 0o600))
	out = root.ok("apply", "-f", file)
	require.Contains(t, out, "~ DeploymentTraffic shared http://vllm-a:8000/v1 (m)")
	got = root.okJSON("traffic", "deployment", "get", a)
	require.EqualValues(t, 16384, toInt(t, firstOf(got, "max_prefill_tokens_in_flight", "maxPrefillTokensInFlight")))
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file))

	// A negative cap is refused by the admin API.
	require.NoError(t, os.WriteFile(file, []byte(doc(16, 4, -1)), 0o600))
	r := root.runIn("", "apply", "-f", file)
	require.NotZero(t, r.code)
	require.Contains(t, r.stderr, "invalid_argument")
	require.Contains(t, r.stderr, "traffic.max_prefill_tokens_in_flight")
}

func firstOf(m map[string]any, keys ...string) any {
	for _, k := range keys {
		if v, ok := m[k]; ok {
			return v
		}
	}
	return nil
}

func toInt(t *testing.T, v any) int64 {
	t.Helper()
	switch x := v.(type) {
	case float64:
		return int64(x)
	case string:
		n, err := strconv.ParseInt(x, 10, 64)
		require.NoError(t, err)
		return n
	}
	t.Fatalf("not a number: %v", v)
	return 0
}

// TestGetDeploymentTrafficRoundTrip: get -o yaml writes a deployment's
// traffic settings (reserve, batch cap, prefill cap, priority scheduling,
// class priorities, queues) as apply's traffic: accepts them: applying the
// output is a no-op, and after the live settings changed it restores them
// exactly; a deployment without traffic settings gets no traffic: key.
func TestGetDeploymentTrafficRoundTrip(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	file := filepath.Join(t.TempDir(), "fleet.yaml")
	doc := func(traffic string) string {
		return `kind: ModelGroup
name: shared
platform_wide: true
routing: {strategy: least_outstanding}
deployments:
  - api_base: http://vllm-a:8000/v1
    upstream_model: m
    free: true
    max_concurrency: 16
    traffic: ` + traffic + `
  - api_base: http://vllm-b:8000/v1
    upstream_model: m
    free: true
`
	}
	full := `{interactive_reserve: 4, batch_max_concurrency: 6, max_prefill_tokens_in_flight: 8192, priority_scheduling: true,
      class_priority: {interactive: 0, batch: 30}, queues: [{traffic_class: TRAFFIC_CLASS_BATCH, max_length: 50, timeout_ms: 60000}]}`
	require.NoError(t, os.WriteFile(file, []byte(doc(full)), 0o600))
	root.ok("apply", "-f", file)
	y := root.ok("get", "model-group", "shared", "-o", "yaml")
	for _, want := range []string{"interactive_reserve: 4", "batch_max_concurrency: 6", "max_prefill_tokens_in_flight: 8192",
		"priority_scheduling: true", "batch: 30", "traffic_class: TRAFFIC_CLASS_BATCH", "max_length: 50", "timeout_ms: 60000"} {
		require.Contains(t, y, want)
	}
	require.Equal(t, 1, strings.Count(y, "traffic:"), "only the deployment with settings has traffic:\n%s", y)
	r := root.runIn(y, "apply", "-f", "-")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "Applied: no changes.\n", r.stdout)

	// Other live settings: applying the earlier output restores them.
	require.NoError(t, os.WriteFile(file, []byte(doc(`{max_prefill_tokens_in_flight: 100}`)), 0o600))
	require.Contains(t, root.ok("apply", "-f", file), "~ DeploymentTraffic shared http://vllm-a:8000/v1 (m)")
	r = root.runIn(y, "apply", "-f", "-")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, []string{"~ DeploymentTraffic shared http://vllm-a:8000/v1 (m)"}, planLines(r.stdout))
	require.Equal(t, y, root.ok("get", "model-group", "shared", "-o", "yaml"))
}

// TestApplyModelGroupTraffic: a group's traffic settings (prefill
// isolation) are applied after its deployments, so a new group with two
// deployments can keep one free; re-applying changes nothing; one at the
// number of deployments is the admin API's InvalidArgument.
func TestApplyModelGroupTraffic(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	file := filepath.Join(t.TempDir(), "fleet.yaml")
	doc := func(k int) string {
		return `kind: ModelGroup
name: isolated
platform_wide: true
traffic: {prefill_isolation: ` + strconv.Itoa(k) + `}
deployments:
  - api_base: http://vllm-a:8000/v1
    upstream_model: m
    free: true
  - api_base: http://vllm-b:8000/v1
    upstream_model: m
    free: true
`
	}
	require.NoError(t, os.WriteFile(file, []byte(doc(1)), 0o600))
	out := root.ok("apply", "-f", file)
	require.Contains(t, out, "ModelGroupTraffic isolated")
	got := root.okJSON("traffic", "model-group", "get", "isolated")
	require.EqualValues(t, 1, toInt(t, firstOf(got, "prefill_isolation", "prefillIsolation")))
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file))

	require.NoError(t, os.WriteFile(file, []byte(doc(2)), 0o600))
	r := root.runIn("", "apply", "-f", file)
	require.NotZero(t, r.code)
	require.Contains(t, r.stderr, "invalid_argument")
	require.Contains(t, r.stderr, "traffic.prefill_isolation")
}
