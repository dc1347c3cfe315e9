package usage

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/google/go-cmp/cmp"

	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// streamBatch is one message of the usage stream, decoded.
type streamBatch struct {
	batch  bool
	msgID  string
	bytes  int
	events []*usagev1.UsageEvent
}

// streamMessages returns every message of the usage stream, decoding
// single events and batches by their encoding header.
func (b *bundle) streamMessages() []streamBatch {
	b.t.Helper()
	js, err := jetstream.New(b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := js.OrderedConsumer(ctx, wire.UsageStream, jetstream.OrderedConsumerConfig{})
	require.NoError(b.t, err)
	n := b.streamMsgs()
	var out []streamBatch
	for i := uint64(0); i < n; i++ {
		m, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
		require.NoError(b.t, err)
		sb := streamBatch{msgID: m.Headers().Get(jetstream.MsgIDHeader), bytes: len(m.Data())}
		switch enc := m.Headers().Get(wire.UsageEncodingHeader); enc {
		case "":
			ev := &usagev1.UsageEvent{}
			require.NoError(b.t, proto.Unmarshal(m.Data(), ev))
			sb.events = []*usagev1.UsageEvent{ev}
		case wire.UsageEncodingBatchV1:
			sb.batch = true
			bt := &usagev1.UsageBatch{}
			require.NoError(b.t, proto.Unmarshal(m.Data(), bt))
			require.Equal(b.t, wire.UsageBatchMsgIDPrefix+bt.GetBatchId(), sb.msgID)
			sb.events = bt.GetEvents()
		default:
			b.t.Fatalf("unknown encoding %q", enc)
		}
		out = append(out, sb)
	}
	return out
}

// eventIDs counts the request ids of every event in the stream.
func eventIDs(msgs []streamBatch) map[string]int {
	out := map[string]int{}
	for _, m := range msgs {
		for _, ev := range m.events {
			out[ev.GetRequestId()]++
		}
	}
	return out
}

func TestBatchEncodingIsAUsageBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, err := New(Config{Region: "eu", BatchEvents: 10}, b.nc)
	require.NoError(t, err)
	var items []item
	var want []*usagev1.UsageEvent
	for i := range 3 {
		ev := event(i)
		data, err := proto.Marshal(ev)
		require.NoError(t, err)
		items = append(items, item{id: ev.RequestId, data: data})
		want = append(want, ev)
	}
	m := p.newMessage(items, true)
	require.True(t, m.batch)
	got := &usagev1.UsageBatch{}
	require.NoError(t, proto.Unmarshal(m.data, got))
	require.Empty(t, cmp.Diff(want, got.GetEvents(), protocmp.Transform()))
	require.Equal(t, wire.UsageBatchMsgIDPrefix+got.GetBatchId(), m.id)
	require.Equal(t, wire.UsageEncodingBatchV1, m.natsMsg("x").Header.Get(wire.UsageEncodingHeader))
	require.NotEqual(t, m.id, p.newMessage(items, true).id, "every batch has its own id")
}

// TestBatchesFormedUnderConcurrency: events recorded by many goroutines
// travel in batches bounded by count and bytes, each exactly once.
func TestBatchesFormedUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const workers, per = 16, 250
	p, _ := b.start(Config{BatchEvents: 64, BatchBytes: 6000, Linger: 5 * time.Millisecond})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				p.Record(event(w*per + i))
			}
		}()
	}
	wg.Wait()
	require.Eventually(t, func() bool { return p.Stats().Published == workers*per }, 20*time.Second, 10*time.Millisecond,
		"stats %+v", p.Stats())
	msgs := b.streamMessages()
	ids := eventIDs(msgs)
	require.Len(t, ids, workers*per)
	for id, n := range ids {
		require.Equal(t, 1, n, id)
	}
	maxEvents := 0
	for _, m := range msgs {
		require.True(t, m.batch, "every message is a batch")
		require.LessOrEqual(t, len(m.events), 64, "count bound")
		require.LessOrEqual(t, m.bytes, 6000, "byte bound")
		maxEvents = max(maxEvents, len(m.events))
	}
	// 4,000 events recorded at once: far fewer messages than events.
	require.Less(t, len(msgs), workers*per/10, "batches formed: %d messages for %d events", len(msgs), workers*per)
	st := p.Stats()
	require.Equal(t, int64(len(msgs)), st.Messages)
	require.Zero(t, st.Spooled)
	require.Zero(t, st.Dropped)
	require.Eventually(t, func() bool { return p.Stats().Buffered == 0 }, 5*time.Second, 10*time.Millisecond)
	t.Logf("%d events in %d messages (largest %d events)", workers*per, len(msgs), maxEvents)
}

// TestBatchLingerSendsAnUnfilledBatch: a lone event is published after the
// linger, not held until the batch fills.
func TestBatchLingerSendsAnUnfilledBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, _ := b.start(Config{BatchEvents: 100, Linger: 20 * time.Millisecond})
	p.Record(event(1))
	p.Record(event(2))
	b.waitMsgs(1, 5*time.Second)
	msgs := b.streamMessages()
	require.Len(t, msgs, 1)
	require.Len(t, msgs[0].events, 2)
}

// TestNATSOutageMidBatchSpoolsAndReplaysEveryEvent: NATS goes away while
// events are being recorded and batched; what the buffer cannot hold is
// spooled; after NATS returns every event is in the stream (a batch
// republished after a lost ack has the same message id, so JetStream
// keeps one copy).
func TestNATSOutageMidBatchSpoolsAndReplaysEveryEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dir := t.TempDir()
	p, _ := b.start(Config{BufferSize: 50, BatchSize: 40, BatchEvents: 16, Linger: 2 * time.Millisecond, SpoolDir: dir})
	const n = 600
	var wg sync.WaitGroup
	stopped := make(chan struct{})
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range n / 4 {
				p.Record(event(w*(n/4) + i))
				if w == 0 && i == 40 {
					b.nats.Stop()
					close(stopped)
				}
				if i%10 == 0 {
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	<-stopped
	st := p.Stats()
	require.Positive(t, st.Spooled, "beyond buffer and ack window events are spooled: %+v", st)
	require.Zero(t, st.Dropped)
	b.nats.Start()
	require.Eventually(t, func() bool {
		st := p.Stats()
		return st.Buffered == 0 && st.SpoolBytes == 0 && st.Replayed == st.Spooled
	}, 30*time.Second, 20*time.Millisecond, "stats %+v", p.Stats())
	ids := eventIDs(b.streamMessages())
	require.Len(t, ids, n, "nothing lost")
	st = p.Stats()
	require.Zero(t, st.Dropped)
	// Whether any batch is republished depends on timing: a batch
	// published while the client reconnects waits in its reconnect buffer
	// and is acknowledged once NATS is back unless its ack times out
	// first. Both ways end with every event in the stream exactly once
	// (above). Retries that keep their message ids, so that JetStream
	// stores one copy, are TestNATSDownEventsWaitInTheBufferAndArriveAfter's
	// (NATS down before the first publish: retries are certain there). A
	// CI run found Retries 0 here.
	t.Logf("stats after the outage: %+v", st)
}

// TestBatchShutdownSpoolsWhatRemains: a batch being filled and batches
// awaiting acks when the publisher stops with NATS away are spooled and
// replayed by the next instance.
func TestBatchShutdownSpoolsWhatRemains(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dir := t.TempDir()
	p, stop := b.start(Config{SpoolDir: dir, BatchEvents: 8, Linger: time.Hour, FlushTimeout: 200 * time.Millisecond})
	b.nats.Stop()
	for i := range 45 { // five full batches and one being filled
		p.Record(event(i))
	}
	stop()
	st := p.Stats()
	require.Equal(t, int64(45), st.Spooled)
	require.Zero(t, st.Dropped)
	require.Zero(t, st.Buffered)
	b.nats.Start()
	p2, _ := b.start(Config{SpoolDir: dir, BatchEvents: 8})
	require.Eventually(t, func() bool { return p2.Stats().Replayed == 45 }, 20*time.Second, 20*time.Millisecond)
	require.Len(t, eventIDs(b.streamMessages()), 45)
}
