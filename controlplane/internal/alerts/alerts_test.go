package alerts

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

type bundle struct {
	t    *testing.T
	pool *pgxpool.Pool
	st   *store.Store
	js   jetstream.JetStream
}

// setup returns a fresh database, an embedded NATS with the alert stream
// (as the publisher creates it) and a running consumer.
func setup(t *testing.T) (*bundle, *Consumer) {
	t.Helper()
	pool, _ := testsvc.NewPool(t)
	nc, err := nats.Connect(testsvc.StartNATS(t).URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: wire.AlertStream, Subjects: []string{wire.AlertSubjectAll}, Storage: jetstream.FileStorage,
		Duplicates: 2 * time.Minute, MaxAge: 7 * 24 * time.Hour,
	})
	require.NoError(t, err)
	b := &bundle{t: t, pool: pool, st: store.New(pool, nil), js: js}
	c, err := New(Config{FetchWait: 100 * time.Millisecond, BatchSize: 50, MaxBackoff: 200 * time.Millisecond,
		TxTimeout: 2 * time.Second, AckWait: 5 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, b.st, nc)
	require.NoError(t, err)
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })
	return b, c
}

// publish sends data with msgID as its dedupe id, as a data plane does.
func (b *bundle) publish(data []byte, msgID string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := b.js.Publish(ctx, wire.AlertSubject("eu"), data, jetstream.WithMsgID(msgID))
	require.NoError(b.t, err)
}

func (b *bundle) publishAlert(a *usagev1.BudgetAlert, msgID string) {
	b.t.Helper()
	data, err := wire.Marshal(a)
	require.NoError(b.t, err)
	b.publish(data, msgID)
}

var fired = time.Date(2026, 11, 17, 10, 30, 0, 0, time.UTC)

// alert i: key budgets of key_<i%3> crossing 50/85/95/100 % in November.
func alert(i int) *usagev1.BudgetAlert {
	pct := []int32{50, 85, 95, 100}[i%4]
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC).Unix()
	key := fmt.Sprintf("key_%d", i%3)
	return &usagev1.BudgetAlert{
		AlertId: fmt.Sprintf("org_a/key/%s/1mo/%d/%d/%d", key, start, pct, i), Time: timestamppb.New(fired.Add(time.Duration(i) * time.Second)),
		OrgId: "org_a", TeamId: "team_t", ScopeKind: "key", ScopeId: key, ThresholdPercent: pct,
		SpendMicros: int64(pct) * 100_000, CapMicros: 10_000_000, SoftMicros: 2_500_000, Window: "1mo", WindowStart: start,
		Region: "eu", InstanceId: "dp-1", RequestId: fmt.Sprintf("req_%d", i),
	}
}

func TestRecordsEveryAlertOnce(t *testing.T) {
	t.Parallel()
	b, c := setup(t)
	const n = 40
	for i := range n {
		b.publishAlert(alert(i), alert(i).AlertId)
		if i%4 == 0 {
			// Republished with the same id: JetStream drops it.
			b.publishAlert(alert(i), alert(i).AlertId)
			// The same alert from another data plane, or after the dedupe
			// window (another message id): the table drops it.
			b.publishAlert(alert(i), "copy-"+alert(i).AlertId)
		}
	}
	require.Eventually(t, func() bool { s := c.Stats(); return s.Recorded+s.Duplicates == n+n/4 }, 15*time.Second, 20*time.Millisecond)
	s := c.Stats()
	require.Equal(t, int64(n), s.Recorded)
	require.Equal(t, int64(n/4), s.Duplicates)
	require.Zero(t, s.Undecodable)

	got, err := b.st.AlertList(context.Background(), store.AlertQuery{}, 1000)
	require.NoError(t, err)
	require.Len(t, got, n)
	// Newest first; every field survives.
	want := alert(n - 1)
	require.Equal(t, store.BudgetAlert{
		AlertID: want.AlertId, FiredAt: fired.Add((n - 1) * time.Second), OrgID: "org_a", TeamID: "team_t", ScopeKind: "key",
		ScopeID: want.ScopeId, ThresholdPercent: want.ThresholdPercent, SpendMicros: want.SpendMicros, CapMicros: 10_000_000,
		SoftMicros: 2_500_000, Window: "1mo", WindowStart: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), Region: "eu",
		InstanceID: "dp-1", RequestID: want.RequestId,
	}, got[0])
}

func TestMalformedAlertsAreTerminated(t *testing.T) {
	t.Parallel()
	b, c := setup(t)
	ctx := context.Background()
	b.publish([]byte{0xff, 0xff, 0xff}, "garbage")
	noID := alert(1)
	noID.AlertId = ""
	b.publishAlert(noID, "no-id")
	noOrg := alert(2)
	noOrg.OrgId = ""
	b.publishAlert(noOrg, "no-org")
	nul := alert(3)
	nul.ScopeId = "key_\x00"
	b.publishAlert(nul, "nul")
	farFuture := alert(4)
	farFuture.WindowStart = 1 << 60
	b.publishAlert(farFuture, "far-future")
	// Without a time, an alert takes the time JetStream stored it.
	noTime := alert(5)
	noTime.Time = nil
	before := time.Now()
	b.publishAlert(noTime, noTime.AlertId)
	require.Eventually(t, func() bool { s := c.Stats(); return s.Undecodable == 5 && s.Recorded == 1 }, 10*time.Second, 20*time.Millisecond)
	// Terminated messages are not redelivered.
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, int64(5), c.Stats().Undecodable)
	cons, err := b.js.Consumer(ctx, wire.AlertStream, DefaultDurable)
	require.NoError(t, err)
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	require.Zero(t, info.NumAckPending)
	require.Zero(t, info.NumPending)
	got, err := b.st.AlertList(ctx, store.AlertQuery{}, 10)
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, noTime.AlertId, got[0].AlertID)
	require.WithinRange(t, got[0].FiredAt, before.Add(-time.Second), time.Now())
}
