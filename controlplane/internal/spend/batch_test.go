package spend

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// publishMsg publishes data with the given encoding header ("" for none,
// a single event) and JetStream message id.
func (b *bundle) publishMsg(data []byte, encoding, msgID string) {
	b.t.Helper()
	m := &nats.Msg{Subject: wire.UsageSubject("eu"), Data: data, Header: nats.Header{}}
	if encoding != "" {
		m.Header.Set(wire.UsageEncodingHeader, encoding)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := b.js.PublishMsg(ctx, m, jetstream.WithMsgID(msgID))
	require.NoError(b.t, err)
}

// publishBatch publishes events [from, to) of event() as one batch, plus
// the extra events.
func (b *bundle) publishBatch(id string, from, to int, extra ...*usagev1.UsageEvent) {
	b.t.Helper()
	batch := &usagev1.UsageBatch{BatchId: id}
	for i := from; i < to; i++ {
		batch.Events = append(batch.Events, event(i))
	}
	batch.Events = append(batch.Events, extra...)
	data, err := proto.Marshal(batch)
	require.NoError(b.t, err)
	b.publishMsg(data, wire.UsageEncodingBatchV1, wire.UsageBatchMsgIDPrefix+id)
}

// TestBatchesAndSingleEventsShareOneLedger: a rolling upgrade has old data
// planes publishing single events next to new ones publishing batches;
// the ledger holds each request once, with exact aggregates, whatever
// the mix, including a batch that repeats a request id, a batch that
// repeats another batch's events (a data plane that republished outside
// the dedupe window) and single events also sent in a batch.
func TestBatchesAndSingleEventsShareOneLedger(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c, _ := b.run(st)
	// Old data planes: events 0-99 one per message.
	for i := range 100 {
		b.publish(event(i), event(i).RequestId)
	}
	// New data planes: 100-399 in batches of 30 (a transaction takes
	// whole batches: 50 per transaction in this consumer's config).
	for i := 100; i < 400; i += 30 {
		b.publishBatch(fmt.Sprintf("dp1-%d", i), i, min(i+30, 400))
	}
	// A batch repeating one of its own request ids, and one of a single
	// event already recorded.
	b.publishBatch("dup-inside", 400, 410, event(405), event(3))
	// A batch whose events another batch already carried.
	b.publishBatch("republished", 100, 130)
	// A single event also sent in a batch.
	b.publish(event(200), "single-copy-of-200")
	require.Eventually(t, func() bool {
		s := c.Stats()
		return s.Recorded == 410
	}, 20*time.Second, 20*time.Millisecond, "stats %+v", c.Stats())
	// Let any stray copy arrive, then check exactness.
	require.Eventually(t, func() bool { return c.Stats().Duplicates == 2+30+1 }, 10*time.Second, 20*time.Millisecond,
		"stats %+v", c.Stats())
	b.checkLedger(st, 410)
	s := c.Stats()
	require.Zero(t, s.Undecodable)
	require.Zero(t, s.NotYet)
}

// TestBatchEventWithoutRequestIDIsRejectedAlone: the batch's other events
// are recorded, the bad one counted.
func TestBatchEventWithoutRequestIDIsRejectedAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c, _ := b.run(st)
	bad := event(999)
	bad.RequestId = ""
	b.publishBatch("with-bad", 0, 5, bad)
	b.publishMsg([]byte{0xff, 0xff}, wire.UsageEncodingBatchV1, "garbage-batch") // does not decode
	b.publishBatch("after", 5, 10)
	require.Eventually(t, func() bool { s := c.Stats(); return s.Recorded == 10 && s.Undecodable == 2 }, 10*time.Second,
		20*time.Millisecond, "stats %+v", c.Stats())
	b.checkLedger(st, 10)
}

// TestUnknownEncodingWaitsInTheStream: a message from a newer data plane
// is neither recorded nor terminated; the messages after it are recorded.
func TestUnknownEncodingWaitsInTheStream(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c, _ := b.run(st)
	data, err := proto.Marshal(event(50))
	require.NoError(t, err)
	b.publishMsg(data, "batch.v9", "future")
	b.publishBatch("now", 0, 10)
	require.Eventually(t, func() bool { s := c.Stats(); return s.Recorded == 10 && s.NotYet >= 1 }, 10*time.Second,
		20*time.Millisecond, "stats %+v", c.Stats())
	require.Zero(t, c.Stats().Undecodable)
	b.checkLedger(st, 10)
	// Still pending in JetStream: not acknowledged, not terminated.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := b.js.Consumer(ctx, wire.UsageStream, DefaultDurable)
	require.NoError(t, err)
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, info.NumAckPending, "the unreadable message waits for a newer control plane")
}

// TestBatchReadAsAnOldEventHasNoRequestID: what a control plane from before
// batches makes of one (it decodes every message as a UsageEvent): an
// event without a request id, which it terminates — never a ledger row
// made of an encoded event.
func TestBatchReadAsAnOldEventHasNoRequestID(t *testing.T) {
	t.Parallel()
	data, err := proto.Marshal(&usagev1.UsageBatch{BatchId: "b1", Events: []*usagev1.UsageEvent{event(1), event(2)}})
	require.NoError(t, err)
	ev := &usagev1.UsageEvent{}
	require.NoError(t, proto.Unmarshal(data, ev))
	require.Empty(t, ev.GetRequestId())
	require.Empty(t, ev.GetOrgId())
}
