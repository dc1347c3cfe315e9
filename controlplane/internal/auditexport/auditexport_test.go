package auditexport

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
)

type rig struct {
	t    *testing.T
	pool *pgxpool.Pool
	st   *store.Store
	nc   *nats.Conn
	js   jetstream.JetStream
	cfg  Config
}

func newRig(t *testing.T) *rig {
	t.Helper()
	pool, _ := testsvc.NewPool(t)
	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	st := store.New(pool, time.Now)
	return &rig{t: t, pool: pool, st: st, nc: nc, js: js,
		cfg: Config{Pool: pool, NC: nc, Poll: 50 * time.Millisecond, Retention: time.Hour}}
}

// start runs an exporter until the returned stop is called (abruptly:
// its context is cancelled wherever it is).
func (r *rig) start() (stop func()) {
	e, err := New(r.cfg)
	require.NoError(r.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = e.Run(ctx) }()
	return func() { cancel(); <-done }
}

// mutate commits n audited mutations from n goroutines at once.
func (r *rig) mutate(n int) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs <- r.st.Mutate(context.Background(), store.Actor{ID: "test", TokenID: "test"}, func(tx *store.Tx) error {
				return tx.Audit(context.Background(), audit.ActionUpdated, "org", fmt.Sprintf("org_%d", i), "", "", nil,
					[]byte(fmt.Sprintf(`{"i":%d}`, i)))
			})
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(r.t, err)
	}
}

func (r *rig) streamMsgs() uint64 {
	s, err := r.js.Stream(context.Background(), StreamName)
	if err != nil {
		return 0
	}
	info, err := s.Info(context.Background())
	require.NoError(r.t, err)
	return info.State.Msgs
}

// rebuild reads the whole stream, from the stream alone, and verifies
// it: sequences 1..want in stream order, each record's hash and link,
// and the last hash equal to the chain head.
func (r *rig) rebuild(want int) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := r.js.Stream(ctx, StreamName)
	require.NoError(r.t, err)
	info, err := s.Info(ctx)
	require.NoError(r.t, err)
	require.Equal(r.t, uint64(want), info.State.Msgs, "the stream holds exactly one message per record")
	v := audit.NewVerifier()
	for i := uint64(1); i <= info.State.LastSeq; i++ {
		raw, err := s.GetMsg(ctx, i)
		require.NoError(r.t, err)
		var m Message
		require.NoError(r.t, json.Unmarshal(raw.Data, &m))
		require.Equal(r.t, int64(i), m.Seq, "stream message %d holds audit record %d: out of chain order or duplicated", i, m.Seq)
		require.Equal(r.t, fmt.Sprint(m.Seq), raw.Header.Get(SeqHeader))
		rec := m.Record()
		require.Nil(r.t, v.Next(&rec), "record %d breaks the chain rebuilt from the stream", m.Seq)
	}
	var headSeq int64
	var headHash []byte
	require.NoError(r.t, r.pool.QueryRow(ctx, `SELECT audit_seq, audit_hash FROM chain_head`).Scan(&headSeq, &headHash))
	require.Nil(r.t, v.End(headSeq, headHash), "the stream ends at the chain head")
}

func (r *rig) waitMsgs(n uint64) {
	r.t.Helper()
	require.Eventually(r.t, func() bool { return r.streamMsgs() >= n }, 60*time.Second, 10*time.Millisecond,
		"stream reached %d of %d messages", r.streamMsgs(), n)
}

// TestThousandConcurrentMutationsExportInChainOrder: 1,000 concurrent
// mutations → exactly 1,000 messages, in chain order, that rebuild and
// verify the chain.
func TestThousandConcurrentMutationsExportInChainOrder(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	stop := r.start()
	defer stop()
	r.mutate(1000)
	r.waitMsgs(1000)
	r.rebuild(1000)
	pos, err := r.st.AuditExportPosition(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(1000), pos)
}

// TestExporterKilledMidBurstLosesAndDuplicatesNothing kills exporters
// abruptly, over and over, while 1,000 mutations commit; it also winds
// the position back (a crash after publishing, before marking), then
// lets a last exporter finish: the stream holds each record once, in
// order.
func TestExporterKilledMidBurstLosesAndDuplicatesNothing(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	burst := make(chan struct{})
	go func() { defer close(burst); r.mutate(1000) }()
	for kill := 0; kill < 5; kill++ {
		stop := r.start()
		have := r.streamMsgs()
		require.Eventually(t, func() bool {
			select {
			case <-burst:
				return true
			default:
			}
			return r.streamMsgs() > have
		}, 30*time.Second, time.Millisecond)
		stop()
		// Published but not marked: the next exporter must not
		// republish these.
		_, err := r.pool.Exec(context.Background(), `UPDATE audit_export SET published_seq = GREATEST(published_seq - 25, 0)`)
		require.NoError(t, err)
	}
	<-burst
	stop := r.start()
	defer stop()
	r.waitMsgs(1000)
	require.Eventually(t, func() bool {
		pos, err := r.st.AuditExportPosition(context.Background())
		return err == nil && pos == 1000
	}, 30*time.Second, 10*time.Millisecond)
	r.rebuild(1000)
}

// TestOneExporterLeads: two exporters running at once still publish
// each record once.
func TestOneExporterLeads(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	stop1, stop2 := r.start(), r.start()
	defer stop1()
	defer stop2()
	r.mutate(200)
	r.waitMsgs(200)
	r.rebuild(200)
}
