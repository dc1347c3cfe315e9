package controlplane

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// A budget alert a data plane publishes reaches AlertService.ListAlerts
// exactly once, however often it is published: the control plane creates
// SLUICE_ALERTS, consumes it and records the alert idempotently.
func TestBudgetAlertPublishedTwiceIsListedOnce(t *testing.T) {
	t.Parallel()
	ns := testsvc.StartNATS(t)
	token := strings.Repeat("b", 40)
	cp, err := New(context.Background(), Config{DatabaseURL: testsvc.NewDatabase(t), AdminAddr: "127.0.0.1:0", KeyPepper: pepper,
		KEK: kek, NATSURL: ns.URL, BootstrapToken: token})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(15 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})

	nc, err := nats.Connect(ns.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	alert := &usagev1.BudgetAlert{
		AlertId: "org_1/key/key_1/1mo/1793491200/85", Time: timestamppb.New(start.Add(time.Hour)), OrgId: "org_1",
		TeamId: "team_1", ScopeKind: "key", ScopeId: "key_1", ThresholdPercent: 85, SpendMicros: 8_600_000,
		CapMicros: 10_000_000, Window: "1mo", WindowStart: start.Unix(), Region: "default", InstanceId: "dp-1", RequestId: "req_1",
	}
	data, err := wire.Marshal(alert)
	require.NoError(t, err)
	publish := func(msgID string) {
		t.Helper()
		pctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for {
			// The publishing leader creates the stream shortly after start.
			_, err := js.Publish(pctx, wire.AlertSubject("default"), data, jetstream.WithMsgID(msgID))
			if err == nil {
				return
			}
			require.NoError(t, pctx.Err(), "publish: %v", err)
			time.Sleep(50 * time.Millisecond)
		}
	}
	publish(alert.AlertId)
	publish(alert.AlertId) // JetStream drops it (Nats-Msg-Id)
	publish("another-data-plane:" + alert.AlertId)
	// The third copy passes JetStream's dedupe; the table drops it.
	metric := func(name string) string {
		resp, err := http.Get("http://" + cp.Addr() + "/metrics")
		if err != nil {
			return ""
		}
		defer resp.Body.Close()
		m, _ := io.ReadAll(resp.Body)
		for line := range strings.Lines(string(m)) {
			if v, ok := strings.CutPrefix(line, name+" "); ok {
				return strings.TrimSpace(v)
			}
		}
		return ""
	}
	require.Eventually(t, func() bool {
		return metric("sluice_control_budget_alerts_recorded_total") == "1" && metric("sluice_control_budget_alerts_duplicates_total") == "1"
	}, 20*time.Second, 50*time.Millisecond)

	client := adminv1connect.NewAlertServiceClient(http.DefaultClient, "http://"+cp.Addr(), connect.WithInterceptors(
		connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
			return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
				req.Header().Set("Authorization", "Bearer "+token)
				return next(ctx, req)
			}
		})))
	resp, err := client.ListAlerts(context.Background(), connect.NewRequest(&adminv1.ListAlertsRequest{OrgId: "org_1"}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.Alerts, 1)
	got := resp.Msg.Alerts[0]
	require.Equal(t, alert.AlertId, got.AlertId)
	require.Equal(t, "key_1", got.ScopeId)
	require.Equal(t, int32(85), got.ThresholdPercent)
	require.InDelta(t, 8.6, got.SpendUsd, 1e-9)
	require.InDelta(t, 10.0, got.CapUsd, 1e-9)
	require.Equal(t, start, got.WindowStart.AsTime())
}
