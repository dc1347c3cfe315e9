package system

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// These tests run the whole ledger: the data plane's usage publisher, the
// SLUICE_USAGE stream, the control plane's spend consumer, Postgres, and
// SpendService to read the result.

func (d *dist) spendClient() adminv1connect.SpendServiceClient {
	return adminv1connect.NewSpendServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
}

// ledgerIDs returns the request ids in the ledger (every page) for org.
func (d *dist) ledgerIDs(org string) map[string]*adminv1.SpendLog {
	d.T.Helper()
	out := map[string]*adminv1.SpendLog{}
	req := &adminv1.ListSpendLogsRequest{OrgId: org, PageSize: 500}
	for {
		r, err := d.spendClient().ListSpendLogs(context.Background(), connect.NewRequest(req))
		require.NoError(d.T, err)
		for _, l := range r.Msg.Logs {
			require.NotContains(d.T, out, l.RequestId, "request %s listed twice", l.RequestId)
			out[l.RequestId] = l
		}
		if r.Msg.NextPageToken == "" {
			return out
		}
		req.PageToken = r.Msg.NextPageToken
	}
}

// spendConsumerInfo describes the spend consumer's state in JetStream,
// for failure messages.
func (d *dist) spendConsumerInfo() string {
	nc, err := nats.Connect(d.NATS.URL)
	if err != nil {
		return err.Error()
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err.Error()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := js.Consumer(ctx, "SLUICE_USAGE", "sluice-spend")
	if err != nil {
		return err.Error()
	}
	info, err := c.Info(ctx)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("pending %d, ack pending %d, redelivered %d, delivered %d, acked %d",
		info.NumPending, info.NumAckPending, info.NumRedelivered, info.Delivered.Stream, info.AckFloor.Stream)
}

func (d *dist) waitLedger(org string, n int, within time.Duration) map[string]*adminv1.SpendLog {
	d.T.Helper()
	var got map[string]*adminv1.SpendLog
	if !harness.Until(func() bool { got = d.ledgerIDs(org); return len(got) >= n }, within, 50*time.Millisecond) {
		d.T.Fatalf("ledger of %s has %d requests, want %d; spend consumer: %s", org, len(got), n, d.spendConsumerInfo())
	}
	time.Sleep(300 * time.Millisecond) // anything extra would arrive now
	got = d.ledgerIDs(org)
	require.Len(d.T, got, n)
	return got
}

// ledgerEvent is request i of org: a priced request on key_i%4.
func ledgerEvent(org, prefix string, i int) *usagev1.UsageEvent {
	return &usagev1.UsageEvent{
		RequestId: fmt.Sprintf("%s_%05d", prefix, i), Time: timestamppb.Now(), Region: "default",
		OrgId: org, TeamId: "team_x", KeyId: fmt.Sprintf("key_%d", i%4), ModelGroup: "qwen", DeploymentId: "dep_1",
		PromptTokens: int64(100 + i), CompletionTokens: int64(i % 50), CostUsd: float64(100+i)*1e-6 + float64(i%50)*2e-6,
		Status: 200, Tags: []string{"ledger"},
	}
}

func (d *dist) checkSums(org string, evs map[string]*usagev1.UsageEvent) {
	d.T.Helper()
	var cost float64
	var prompt, completion int64
	for _, ev := range evs {
		cost += ev.CostUsd
		prompt += ev.PromptTokens
		completion += ev.CompletionTokens
	}
	for _, scope := range []struct {
		s  adminv1.SpendScope
		id string
	}{{adminv1.SpendScope_SPEND_SCOPE_ORG, org}, {adminv1.SpendScope_SPEND_SCOPE_MODEL_GROUP, "qwen"}, {adminv1.SpendScope_SPEND_SCOPE_TAG, "ledger"}} {
		r, err := d.spendClient().GetSpend(context.Background(), connect.NewRequest(&adminv1.GetSpendRequest{Scope: scope.s, Id: scope.id, OrgId: org}))
		require.NoError(d.T, err)
		require.Equal(d.T, int64(len(evs)), r.Msg.Requests, scope.s.String())
		require.Equal(d.T, prompt, r.Msg.PromptTokens, scope.s.String())
		require.Equal(d.T, completion, r.Msg.CompletionTokens, scope.s.String())
		require.InDelta(d.T, cost, r.Msg.SpendUsd, 1e-9, scope.s.String())
	}
}

func TestLedgerRecordsEveryRequestExactlyOnce(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Minute)
	const org = "org_ledger_once"
	evs := map[string]*usagev1.UsageEvent{}
	for i := range 400 {
		ev := ledgerEvent(org, "once", i)
		evs[ev.RequestId] = ev
		p.DP.RecordUsage(ev)
		if i%7 == 0 {
			p.DP.RecordUsage(ledgerEvent(org, "once", i)) // the same request twice
		}
	}
	harness.Eventually(t, func() bool { return p.DP.UsageStats().Published == 400+400/7+1 }, 30*time.Second, 20*time.Millisecond,
		"usage publisher: %+v", p.DP.UsageStats())
	got := d.waitLedger(org, 400, 30*time.Second)
	for id, ev := range evs {
		l := got[id]
		require.NotNil(t, l, id)
		require.Equal(t, ev.PromptTokens, l.PromptTokens)
		require.InDelta(t, ev.CostUsd, l.CostUsd, 1e-12)
	}
	d.checkSums(org, evs)
	require.Zero(t, p.DP.UsageStats().Dropped)
}

func TestLedgerLosesNothingWhileTheConsumerOrNATSIsAway(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Hour)
	const org = "org_ledger_outage"
	evs := map[string]*usagev1.UsageEvent{}
	record := func(prefix string, n int) {
		for i := range n {
			ev := ledgerEvent(org, prefix, i)
			evs[ev.RequestId] = ev
			p.DP.RecordUsage(ev)
		}
	}
	record("before", 50)
	d.waitLedger(org, 50, 30*time.Second)

	// The only control plane (and so the spend consumer) is stopped:
	// events wait in the stream.
	d.Controls[0]()
	record("nocp", 100)
	harness.Eventually(t, func() bool { return p.DP.UsageStats().Published >= 150 }, 10*time.Second, 20*time.Millisecond)
	d.Admin = d.StartControl("cp-2")
	d.waitLedger(org, 150, 30*time.Second)

	// NATS is down: events wait in the data plane's buffer.
	d.NATS.Stop()
	record("nonats", 100)
	harness.Eventually(t, func() bool { return p.DP.UsageStats().Retries > 0 }, 10*time.Second, 20*time.Millisecond)
	require.Positive(t, p.DP.UsageStats().Buffered)
	time.Sleep(500 * time.Millisecond)
	d.NATS.Start()
	d.waitLedger(org, 250, 60*time.Second)
	d.checkSums(org, evs)
	st := p.DP.UsageStats()
	require.Zero(t, st.Dropped)
	require.Zero(t, st.Buffered)
}
