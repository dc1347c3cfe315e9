package spend

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// runDurable is bundle.run on the durable consumer named durable.
func (b *bundle) runDurable(st *store.Store, durable string) *Consumer {
	b.t.Helper()
	c, err := New(Config{Durable: durable, FetchWait: 100 * time.Millisecond, BatchSize: 50, MaxBackoff: 200 * time.Millisecond,
		TxTimeout: 2 * time.Second, AckWait: 5 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, st, b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	b.t.Cleanup(func() { cancel(); <-done })
	return c
}

// TestRedeliveredBatchesRecordNothingTwice: the ledger de-duplicates per
// request id, never per message, for batches redelivered by JetStream.
// Batches published while Postgres is unreachable fail their transaction,
// are negatively acknowledged and redelivered (the same messages), and are
// recorded once when it is back, including one that repeats a request id
// inside itself. Then every batch of the stream is delivered again (a
// second durable consumer reads the whole stream: the same messages, as
// after lost acks): nothing is inserted, every event counts as a
// duplicate, and rows and daily aggregates are unchanged.
func TestRedeliveredBatchesRecordNothingTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	u, err := url.Parse(b.dbURL)
	require.NoError(t, err)
	proxy := startProxy(t, u.Host)
	u.Host = proxy.ln.Addr().String()
	cfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	cfg.ConnConfig.ConnectTimeout = time.Second
	viaProxy, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(viaProxy.Close)
	c := b.runDurable(store.New(viaProxy, nil), DefaultDurable)

	const n, per = 400, 20
	for i := 0; i < n/2; i += per {
		b.publishBatch(fmt.Sprintf("b-%d", i), i, i+per)
	}
	require.Eventually(t, func() bool { return c.Stats().Recorded == n/2 }, 10*time.Second, 20*time.Millisecond, "stats %+v", c.Stats())

	proxy.setDown(true)
	for i := n / 2; i < n; i += per {
		if i == n/2 {
			// A batch carrying one of its request ids twice.
			b.publishBatch(fmt.Sprintf("b-%d", i), i, i+per, event(i+3))
			continue
		}
		b.publishBatch(fmt.Sprintf("b-%d", i), i, i+per)
	}
	require.Eventually(t, func() bool { return c.Stats().Failures >= 2 }, 10*time.Second, 20*time.Millisecond,
		"the consumer keeps failing while Postgres is unreachable")
	require.Equal(t, int64(n/2), c.Stats().Recorded, "recorded while Postgres was unreachable")
	proxy.setDown(false)
	require.Eventually(t, func() bool { return c.Stats().Recorded == n }, 20*time.Second, 20*time.Millisecond, "stats %+v", c.Stats())
	b.checkLedger(store.New(b.pool, nil), n)
	dupBefore := c.Stats().Duplicates
	require.GreaterOrEqual(t, dupBefore, int64(1), "the repeated request id inside a batch is a duplicate")

	// Every batch again, as JetStream redelivers after lost acks.
	again := b.runDurable(store.New(b.pool, nil), "redelivery")
	require.Eventually(t, func() bool { return again.Stats().Duplicates == n+1 }, 20*time.Second, 20*time.Millisecond,
		"stats %+v", again.Stats())
	require.Zero(t, again.Stats().Recorded, "a redelivered batch inserted rows")
	require.Zero(t, again.Stats().Undecodable)
	b.checkLedger(store.New(b.pool, nil), n)
}
