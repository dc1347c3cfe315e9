package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTenancyCommands drives the grant, admin-token rotation and webhook
// commands against a real control plane.
func TestTenancyCommands(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	env := newCLIEnv(t)
	root := env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "tenancy-org")["id"].(string)

	// Grants.
	root.ok("model-group", "create", "private")
	root.ok("model-group", "create", "shared", "--platform-wide")
	require.Contains(t, root.ok("model-group", "grant", "private", orgID), orgID)
	out := root.ok("model-group", "grants", "--model-group", "private")
	require.Contains(t, out, "MODEL GROUP")
	require.Contains(t, out, orgID)
	var g map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("-o", "json", "model-group", "get", "private")), &g))
	require.Equal(t, []any{orgID}, g["granted_org_ids"])
	require.Contains(t, root.ok("model-group", "revoke", "private", orgID), "may no longer use model group private")
	require.NotContains(t, root.ok("model-group", "grants"), orgID)
	r := root.run("model-group", "revoke", "private", orgID)
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, "not found")
	root.ok("model-group", "update", "shared", "--platform-wide=false")
	require.NoError(t, json.Unmarshal([]byte(root.ok("-o", "json", "model-group", "get", "shared")), &g))
	require.Nil(t, g["platform_wide"])

	// Admin token rotation with grace and expiry.
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("-o", "json", "token", "create", "--scope", "org", "--org", orgID, "--role", "admin")), &created))
	tokID, oldTok := obj(t, created, "admin_token")["id"].(string), created["token"].(string)
	var rotated map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("-o", "json", "token", "rotate", tokID, "--grace", "1h")), &rotated))
	newTok := rotated["token"].(string)
	require.NotEqual(t, oldTok, newTok)
	require.Equal(t, tokID, obj(t, rotated, "admin_token")["id"])
	require.NotEmpty(t, obj(t, rotated, "admin_token")["previous_valid_until"])
	for _, tk := range []string{oldTok, newTok} {
		env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+tk).ok("org", "get", orgID)
	}
	require.Contains(t, root.ok("token", "expire", tokID, "--at", "30d"), "expire_time")
	r = root.run("token", "expire", tokID)
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, "exactly one of --at and --never")
	root.ok("token", "expire", tokID, "--never")

	// Webhooks, as the org's admin (the new secret).
	org := env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+newTok)
	var wh map[string]any
	require.NoError(t, json.Unmarshal([]byte(org.ok("-o", "json", "alerts", "webhook", "create", "https://hooks.example.com/sluice", "--description", "pager")), &wh))
	require.Contains(t, wh["secret"], "whsec_")
	whID := obj(t, wh, "webhook")["id"].(string)
	require.Contains(t, org.ok("alerts", "webhook", "list"), whID)
	require.Contains(t, org.ok("alerts", "deliveries", "dead"), "DELIVERY")
	require.Contains(t, org.ok("alerts", "deliveries", "list", "--state", "pending"), "STATE")
	r = org.run("alerts", "deliveries", "list", "--state", "lost")
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, "state")
	var rot map[string]any
	require.NoError(t, json.Unmarshal([]byte(org.ok("-o", "json", "alerts", "webhook", "rotate", whID, "--grace", "24h")), &rot))
	require.Contains(t, rot["secret"], "whsec_")
	require.NotEqual(t, wh["secret"], rot["secret"])
	require.NotEmpty(t, obj(t, rot, "webhook")["previous_secret_valid_until"])
	require.Contains(t, org.fail("alerts", "webhook", "rotate", whID, "--grace", "forever"), "grace_period")
	org.ok("alerts", "webhook", "delete", whID)
	require.NotContains(t, org.ok("alerts", "webhook", "list"), whID)
}
