package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// tenantFile declares an org's people and credentials: teams, users,
// memberships, end customers, keys and classification rules.
const tenantFile = `kind: Org
name: acme
---
kind: Team
org: acme
name: agents
---
kind: User
org: acme
email: ada@example.com
---
kind: User
org: acme
email: bob@example.com
---
kind: Member
org: acme
team: agents
user: ada@example.com
max_budget_in_team: 20
limits: {budget_duration: 30d, rpm_limit: 60}
---
kind: Member
org: acme
team: agents
user: bob@example.com
---
kind: Customer
org: acme
external_id: globex
display_name: Globex
limits: {max_budget: 5, budget_duration: 1d}
---
kind: Customer
org: acme
external_id: initech
---
kind: Key
org: acme
team: agents
alias: ci
user: ada@example.com
tags: [ci]
traffic_class: batch
limits: {rpm_limit: 30}
model_group_aliases: {gpt-4o: qwen}
---
kind: Key
org: acme
team: agents
alias: laptop
---
kind: Key
org: acme
alias: org-wide
project: billing
---
kind: OrgTraffic
org: acme
default_class: TRAFFIC_CLASS_INTERACTIVE
rules:
- {header: User-Agent, pattern: ^claude-code/, traffic_class: TRAFFIC_CLASS_AGENT}
`

// TestApplyTenantKinds: members, customers, keys and org traffic apply
// from one file; a created key's token is printed once; re-applying
// changes nothing and writes no audit row; a change is one update with
// its diff; prune removes exactly what the file dropped.
func TestApplyTenantKinds(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	file := filepath.Join(t.TempDir(), "tenants.yaml")
	require.NoError(t, os.WriteFile(file, []byte(tenantFile), 0o600))

	before := auditCount(t, root)
	dry := root.ok("apply", "-f", file, "--dry-run")
	require.Contains(t, dry, "Dry run: 11 to create, 1 to change, 0 to delete.")
	require.Contains(t, dry, "+ Key acme/agents/ci")
	require.NotContains(t, dry, "sk-sluice-")
	require.Equal(t, before, auditCount(t, root))

	out := root.ok("apply", "-f", file)
	require.Contains(t, out, "Applied: 11 to create, 1 to change, 0 to delete.")
	tokens := regexp.MustCompile(`Created key (\S+) \(key_\w+\): (sk-sluice-\S+)`).FindAllStringSubmatch(out, -1)
	require.Len(t, tokens, 3, out)
	var ci string
	for _, m := range tokens {
		if m[1] == "acme/agents/ci" {
			ci = m[2]
		}
	}
	require.NotEmpty(t, ci)
	applied := auditCount(t, root)

	var keys []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("key", "list", "--alias-prefix", "ci", "-o", "json")), &keys))
	require.Len(t, keys, 1)
	require.Equal(t, "TRAFFIC_CLASS_BATCH", keys[0]["traffic_class"])
	require.NotEmpty(t, keys[0]["user_id"])
	require.NotContains(t, root.ok("key", "list", "-o", "json"), ci, "a token is never listed")
	require.Contains(t, root.ok("customer", "list"), "globex")

	// The second run changes nothing and prints no token.
	again := root.ok("apply", "-f", file)
	require.Equal(t, "Applied: no changes.\n", again)
	require.Equal(t, applied, auditCount(t, root), "re-applying writes no audit row")

	// get -o yaml writes documents apply accepts: applying them changes
	// nothing; no token is ever written.
	var all strings.Builder
	for _, kind := range []string{"org", "team", "user", "member", "customer", "key", "org-traffic"} {
		y := root.ok("get", kind, "--org", "acme")
		require.NotContains(t, y, "sk-sluice-")
		all.WriteString(y)
	}
	require.Contains(t, all.String(), "alias: ci")
	require.Contains(t, all.String(), "user: ada@example.com")
	require.Contains(t, all.String(), "pattern: ^claude-code/")
	r := root.runIn(all.String(), "apply", "-f", "-")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "Applied: no changes.\n", r.stdout)
	require.Equal(t, applied, auditCount(t, root))

	// Changes are updates with their diff, one audit row each.
	changed := strings.Replace(tenantFile, "limits: {rpm_limit: 30}", "limits: {rpm_limit: 45}", 1)
	changed = strings.Replace(changed, "display_name: Globex", "display_name: Globex Corp", 1)
	changed = strings.Replace(changed, "max_budget_in_team: 20", "max_budget_in_team: 25", 1)
	changed = strings.Replace(changed, "^claude-code/", "^(claude-code|codex)/", 1)
	require.NoError(t, os.WriteFile(file, []byte(changed), 0o600))
	dry = root.ok("apply", "-f", file, "--dry-run")
	require.Equal(t, []string{"~ Customer acme/globex", "~ Key acme/agents/ci", "~ Member acme/agents/ada@example.com", "~ OrgTraffic acme"}, planLines(dry))
	require.Contains(t, dry, "limits.rpm_limit: 30 → 45")
	require.Contains(t, dry, "display_name: Globex → Globex Corp")
	out = root.ok("apply", "-f", file)
	require.Contains(t, out, "Applied: 0 to create, 4 to change, 0 to delete.")
	require.Equal(t, applied+4, auditCount(t, root))
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file))
	applied += 4

	// Prune: drop a member, a customer and a key; everything else stays.
	pruned := changed
	for _, drop := range []string{
		"---\nkind: Member\norg: acme\nteam: agents\nuser: bob@example.com\n",
		"---\nkind: Customer\norg: acme\nexternal_id: initech\n",
		"---\nkind: Key\norg: acme\nteam: agents\nalias: laptop\n",
	} {
		require.Contains(t, pruned, drop)
		pruned = strings.Replace(pruned, drop, "", 1)
	}
	require.NoError(t, os.WriteFile(file, []byte(pruned), 0o600))
	require.Contains(t, root.fail("apply", "-f", file, "--prune"), "--yes")
	out = root.ok("apply", "-f", file, "--prune", "--yes")
	require.Equal(t, []string{"- Customer acme/initech", "- Key acme/agents/laptop", "- Member acme/agents/bob@example.com"}, planLines(out))
	require.Equal(t, applied+3, auditCount(t, root))
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file, "--prune", "--yes"))
	require.NotContains(t, root.ok("customer", "list"), "initech")
	require.NotContains(t, root.ok("key", "list"), "laptop")
	require.Contains(t, root.ok("key", "list"), "org-wide")

	// Strict: unknown fields, a missing alias, an unknown traffic field.
	for _, tc := range []struct{ doc, want string }{
		{"kind: Key\norg: acme\nteam: agents\n", "Key: alias is required"},
		{"kind: Key\norg: acme\nalias: x\ntoken: sk-sluice-inline\n", "field token not found in Key"},
		{"kind: Member\norg: acme\nteam: agents\n", "Member: user is required"},
		{"kind: OrgTraffic\norg: acme\nrulez: []\n", "rulez"},
	} {
		r := root.runIn(tc.doc, "apply", "-f", "-", "--dry-run")
		require.NotEqual(t, 0, r.code, tc.doc)
		require.Contains(t, r.stderr, tc.want, tc.doc)
		require.NotContains(t, r.stderr+r.stdout, "sk-sluice-inline")
	}
}
