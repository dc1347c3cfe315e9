package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTokenCreateWithTeamResolvesTheOrg: a platform token (which has no
// org of its own) creates a team token from --team alone.
func TestTokenCreateWithTeamResolvesTheOrg(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	env := newCLIEnv(t)
	root := env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "team-token-org")["id"].(string)
	teamID := root.okJSON("team", "create", "eng", "--org", orgID)["id"].(string)

	r := root.run("-o", "json", "token", "create", "--team", teamID, "--role", "viewer")
	require.Equal(t, 0, r.code, r.stderr)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &created))
	tok := obj(t, created, "admin_token")
	require.Equal(t, "SCOPE_TEAM", tok["scope"])
	require.Equal(t, orgID, tok["org_id"])
	require.Equal(t, teamID, tok["team_id"])

	r = root.run("token", "create", "--team", "team_missing", "--role", "viewer")
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, "resolve the org of team team_missing")
}
