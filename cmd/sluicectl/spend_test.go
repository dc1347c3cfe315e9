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
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// publishUsage publishes usage events to the control plane's NATS as a
// data plane would, waiting for the usage stream to exist.
func publishUsage(t *testing.T, natsURL string, evs []*usagev1.UsageEvent) {
	t.Helper()
	nc, err := nats.Connect(natsURL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, ev := range evs {
		data, err := proto.Marshal(ev)
		require.NoError(t, err)
		for {
			_, err = js.Publish(ctx, wire.UsageSubject("default"), data, jetstream.WithMsgID(ev.RequestId))
			if err == nil || ctx.Err() != nil {
				break
			}
			time.Sleep(50 * time.Millisecond) // the stream is created by the publishing leader
		}
		require.NoError(t, err)
	}
}

func TestSpendGetAndLogs(t *testing.T) {
	t.Parallel()
	server, _, natsURL := startServerNATS(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "spend-org")["id"].(string)
	otherID := root.okJSON("org", "create", "spend-other")["id"].(string)
	teamID := root.okJSON("team", "create", "--org", orgID, "--name", "ml")["id"].(string)

	now := time.Now().UTC()
	var evs []*usagev1.UsageEvent
	for i := range 5 {
		evs = append(evs, &usagev1.UsageEvent{
			RequestId: fmt.Sprintf("req_cli_%d", i), Time: timestamppb.New(now.Add(-time.Duration(i) * time.Minute)),
			Region: "default", OrgId: orgID, TeamId: teamID, KeyId: "key_cli", ModelGroup: "qwen",
			PromptTokens: 100, CompletionTokens: 20, CostUsd: 0.5, Status: 200, LatencyMs: 42,
		})
	}
	evs = append(evs, &usagev1.UsageEvent{RequestId: "req_cli_other", Time: timestamppb.New(now), OrgId: otherID,
		ModelGroup: "qwen", CostUsd: 9, Status: 200})
	publishUsage(t, natsURL, evs)
	publishUsage(t, natsURL, evs[:2]) // republished: deduplicated

	// The control plane's spend consumer records them.
	var logs []map[string]any
	require.Eventually(t, func() bool {
		r := root.run("spend", "logs", "-o", "json")
		logs = nil
		return r.code == 0 && json.Unmarshal([]byte(r.stdout), &logs) == nil && len(logs) == 6
	}, 30*time.Second, 100*time.Millisecond)
	require.Equal(t, "req_cli_other", logs[0]["request_id"], "newest first")

	out := root.ok("spend", "logs", "--team", teamID, "--limit", "2")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 3, out)
	require.Contains(t, lines[0], "REQUEST")
	require.Contains(t, lines[1], "req_cli_0")
	require.Contains(t, lines[1], "$0.500000")

	out = root.ok("spend", "get", "--scope", "team", "--id", teamID, "--since", "2d")
	require.Contains(t, out, "$2.500000 over 5 requests")
	require.Contains(t, out, "500 in, 100 out")
	got := root.okJSON("spend", "get", "--scope", "model_group", "--id", "qwen")
	require.InDelta(t, 11.5, got["spend_usd"], 1e-9)
	got = root.okJSON("spend", "get", "--scope", "model_group", "--id", "qwen", "--org", otherID)
	require.InDelta(t, 9.0, got["spend_usd"], 1e-9)

	// An org token sees only its org.
	r := root.run("-o", "json", "token", "create", "--scope", "org", "--org", otherID, "--role", "viewer", "--name", "other-viewer")
	require.Equal(t, 0, r.code, r.stderr)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &created))
	other := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+created["token"].(string))
	out = other.ok("spend", "logs")
	require.Contains(t, out, "req_cli_other")
	require.NotContains(t, out, "req_cli_0")
	require.Contains(t, other.fail("spend", "get", "--scope", "org", "--id", orgID), "permission_denied")
	require.Contains(t, other.fail("spend", "logs", "--org", orgID), "permission_denied")

	// Client-side and server-side validation.
	require.Contains(t, root.fail("spend", "get", "--scope", "team"), "--id is required")
	require.Contains(t, root.fail("spend", "get"), "--scope and --id are required")
	require.Contains(t, root.fail("spend", "get", "--scope", "team", "--id", teamID, "--since", "1d", "--until", "3d"), "must be after start_time")
}
