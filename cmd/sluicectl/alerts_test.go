package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	"sigs.k8s.io/yaml"

	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// publishAlerts publishes budget alerts to the control plane's NATS as a
// data plane would, waiting for the alert stream to exist.
func publishAlerts(t *testing.T, natsURL string, alerts []*usagev1.BudgetAlert) {
	t.Helper()
	nc, err := nats.Connect(natsURL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, a := range alerts {
		data, err := wire.Marshal(a)
		require.NoError(t, err)
		for {
			_, err = js.Publish(ctx, wire.AlertSubject("default"), data, jetstream.WithMsgID(a.AlertId))
			if err == nil || ctx.Err() != nil {
				break
			}
			time.Sleep(50 * time.Millisecond) // the stream is created by the publishing leader
		}
		require.NoError(t, err)
	}
}

func TestAlertsList(t *testing.T) {
	t.Parallel()
	server, _, natsURL := startServerNATS(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "alerts-org")["id"].(string)
	otherID := root.okJSON("org", "create", "alerts-other")["id"].(string)
	teamID := root.okJSON("team", "create", "--org", orgID, "--name", "ml")["id"].(string)

	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	fired := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	mk := func(org, team, kind, id string, pct int32, at time.Time) *usagev1.BudgetAlert {
		return &usagev1.BudgetAlert{
			AlertId: fmt.Sprintf("%s/%s/%s/1mo/%d/%d", org, kind, id, start.Unix(), pct), Time: timestamppb.New(at),
			OrgId: org, TeamId: team, ScopeKind: kind, ScopeId: id, ThresholdPercent: pct, SpendMicros: 5_500_000,
			CapMicros: 10_000_000, SoftMicros: 5_000_000, Window: "1mo", WindowStart: start.Unix(), Region: "default",
			InstanceId: "dp-1", RequestId: "req_" + kind,
		}
	}
	alerts := []*usagev1.BudgetAlert{
		mk(orgID, teamID, "team", teamID, 50, fired),
		mk(orgID, teamID, "team", teamID, 0, fired.Add(time.Minute)),
		mk(orgID, "", "org", orgID, 50, fired.Add(2*time.Minute)),
		mk(otherID, "", "org", otherID, 100, fired.Add(3*time.Minute)),
	}
	publishAlerts(t, natsURL, alerts)
	publishAlerts(t, natsURL, alerts[:2]) // republished: recorded once

	var all []map[string]any
	require.Eventually(t, func() bool {
		r := root.run("alerts", "list", "-o", "json")
		all = nil
		return r.code == 0 && json.Unmarshal([]byte(r.stdout), &all) == nil && len(all) == 4
	}, 30*time.Second, 100*time.Millisecond)
	require.Equal(t, alerts[3].AlertId, all[0]["alert_id"], "newest first")
	require.Equal(t, 5.5, all[0]["spend_usd"])
	require.Equal(t, "2026-11-01T00:00:00Z", all[0]["window_start"])

	out := root.ok("alerts", "list", "--org", orgID, "--scope-kind", "team", "--scope-id", teamID)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 3, out)
	for _, col := range []string{"TIME", "SCOPE ID", "THRESHOLD", "SPEND", "BUDGET", "WINDOW"} {
		require.Contains(t, lines[0], col)
	}
	require.Contains(t, lines[1], "soft")
	require.Contains(t, lines[1], "$5.500000")
	require.Contains(t, lines[1], "$5.000000") // the soft budget
	require.Contains(t, lines[2], "50%")
	require.Contains(t, lines[2], "$10.000000") // the cap
	require.Contains(t, lines[2], "1mo from 2026-11-01T00:00:00Z")

	var viaYAML []map[string]any
	require.NoError(t, yaml.Unmarshal([]byte(root.ok("alerts", "list", "--team", teamID, "-o", "yaml")), &viaYAML))
	require.Len(t, viaYAML, 2)
	out = root.ok("alert", "ls", "--since", fired.Add(90*time.Second).Format(time.RFC3339), "--limit", "1")
	require.Contains(t, out, otherID)
	require.NotContains(t, out, teamID)

	// An org token sees only its org.
	r := root.run("-o", "json", "token", "create", "--scope", "org", "--org", otherID, "--role", "viewer", "--name", "other-viewer")
	require.Equal(t, 0, r.code, r.stderr)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &created))
	other := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+created["token"].(string))
	out = other.ok("alerts", "list")
	require.Contains(t, out, otherID)
	require.NotContains(t, out, orgID)
	require.Contains(t, other.fail("alerts", "list", "--org", orgID), "permission_denied")
	require.Contains(t, root.fail("alerts", "list", "--scope-kind", "deployment"), "scope_kind: must be one of")
}
