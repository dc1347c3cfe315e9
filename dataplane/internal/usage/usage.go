// Package usage publishes the data plane's usage events (one per request,
// SPEC §9.2) to JetStream, off the request path, without losing them.
//
// Record puts an event in a bounded in-memory buffer and returns at once.
// One drainer goroutine (Run) packs buffered events into JetStream
// messages — one UsageEvent per message, or with BatchEvents > 1 a
// UsageBatch of up to BatchEvents events and BatchBytes bytes, sent when
// full or when its first event has waited Linger — and publishes them to
// the region's usage subject asynchronously, with at most BatchSize events
// awaiting their acks. A message whose publish fails is retried with
// backoff, with the same JetStream message id, for as long as NATS is away
// (the drainer takes nothing new meanwhile). When the buffer is full,
// Record appends the event to an on-disk spool instead, which the drainer
// replays once the buffer has drained. Only when the spool cannot take the
// event either (disk error, spool size limit) is the event dropped: it is
// then counted (sluice_usage_dropped_total) and logged at error level with
// its request id. On shutdown the drainer flushes for a bounded time and
// spools what remains. docs/ledger.md describes the policy.
package usage

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults.
const (
	// DefaultBufferSize is the in-memory buffer, in events: at 1 KiB an
	// event about 10 MiB, and several seconds of a busy proxy's traffic.
	DefaultBufferSize = 10_000
	// DefaultBatchSize bounds the events taken from the buffer and not yet
	// acknowledged (in messages being filled, published or retried): the
	// ack window. Beyond it the drainer waits for acks and the buffer
	// fills.
	DefaultBatchSize = 1024
	// DefaultBatchEvents is what the data plane sets BatchEvents to
	// (dataplane.DefaultUsageBatchEvents): up to a few hundred events per
	// message (DefaultBatchBytes binds first for events over 256 bytes).
	DefaultBatchEvents = 512
	// DefaultBatchBytes bounds an encoded batch (the server's max payload,
	// 1 MiB by default, bounds it too).
	DefaultBatchBytes = 128 << 10
	// DefaultAckTimeout bounds the wait for a publish ack.
	DefaultAckTimeout = 5 * time.Second
	// DefaultMinBackoff and DefaultMaxBackoff bound the wait between
	// publish retries while NATS is unreachable.
	DefaultMinBackoff = 100 * time.Millisecond
	DefaultMaxBackoff = 5 * time.Second
	// DefaultLinger is how long the first event of a batch waits for
	// others before the batch is published unfilled: at 1,000 requests a
	// second a proxy then publishes about 20 events per message, at 5,000
	// about 100. JetStream's cost is per message (its store write, fsynced
	// per message when sync is always on, is most of it), so this sets
	// NATS's CPU per request below the count and byte bounds. It delays
	// the ledger by as much — a tenth of the ledger consumer's own fetch
	// wait — and nothing on the request path.
	DefaultLinger = 20 * time.Millisecond
	// DefaultFlushTimeout bounds the flush at shutdown.
	DefaultFlushTimeout = 5 * time.Second
	// DefaultSpoolMaxBytes bounds the spool on disk (1 GiB, about a
	// million events).
	DefaultSpoolMaxBytes = 1 << 30
)

// Field numbers of sluice.usage.v1.UsageBatch, which the publisher encodes
// by hand from the events' encodings (no re-marshalling; a test checks it
// against the generated code).
const (
	batchEventsField  protowire.Number = 120
	batchIDField      protowire.Number = 121
	batchEventOverhed                  = 2 + 3 // tag of field 120, length of up to 2 MiB
)

// Config configures a Publisher.
type Config struct {
	// Region names the usage subject (wire.UsageSubject).
	Region string
	// BufferSize is the in-memory buffer in events (DefaultBufferSize if 0).
	BufferSize int
	// SpoolDir is where events go when the buffer is full. Empty: a new
	// temporary directory per instance, removed at shutdown when empty
	// (events spooled there at shutdown are not replayed by the next
	// instance; set a persistent directory for that).
	SpoolDir string
	// SpoolMaxBytes bounds the spool (DefaultSpoolMaxBytes if 0).
	SpoolMaxBytes int64
	// BatchEvents, above 1, packs up to that many events into one
	// JetStream message (a UsageBatch, header wire.UsageEncodingHeader);
	// 0 or 1 publishes every event as its own message (a UsageEvent with
	// its request id as message id: the only format control planes before
	// batches read). The data plane sets DefaultBatchEvents.
	BatchEvents int
	// BatchBytes bounds an encoded batch (DefaultBatchBytes if 0).
	BatchBytes int
	// Linger is how long a batch's first event waits for more before the
	// batch is sent unfilled (DefaultLinger if 0). Single events are sent
	// at once.
	Linger time.Duration
	// BatchSize, AckTimeout, MinBackoff, MaxBackoff and FlushTimeout tune
	// publishing (defaults above when 0).
	BatchSize    int
	AckTimeout   time.Duration
	MinBackoff   time.Duration
	MaxBackoff   time.Duration
	FlushTimeout time.Duration
	Logger       *slog.Logger
}

// Validate reports every problem of c at once.
func (c *Config) Validate() error {
	var errs []error
	if !wire.ValidRegion(c.Region) {
		errs = append(errs, fmt.Errorf("usage: region %q is not valid", c.Region))
	}
	if c.BufferSize < 0 {
		errs = append(errs, errors.New("usage buffer size must not be negative"))
	}
	if c.SpoolMaxBytes < 0 {
		errs = append(errs, errors.New("usage spool size limit must not be negative"))
	}
	if c.BatchEvents < 0 || c.BatchBytes < 0 {
		errs = append(errs, errors.New("usage batch events and bytes must not be negative"))
	}
	if c.BatchSize < 0 || c.AckTimeout < 0 || c.MinBackoff < 0 || c.MaxBackoff < 0 || c.FlushTimeout < 0 || c.Linger < 0 {
		errs = append(errs, errors.New("usage publisher batch size and durations must not be negative"))
	}
	return errors.Join(errs...)
}

func (c *Config) defaults() {
	if c.BufferSize == 0 {
		c.BufferSize = DefaultBufferSize
	}
	if c.SpoolMaxBytes == 0 {
		c.SpoolMaxBytes = DefaultSpoolMaxBytes
	}
	if c.BatchEvents == 0 {
		c.BatchEvents = 1
	}
	if c.BatchBytes == 0 {
		c.BatchBytes = DefaultBatchBytes
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.AckTimeout == 0 {
		c.AckTimeout = DefaultAckTimeout
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = DefaultMinBackoff
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.FlushTimeout == 0 {
		c.FlushTimeout = DefaultFlushTimeout
	}
	if c.Linger == 0 {
		c.Linger = DefaultLinger
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// Stats are the publisher's gauges and counters (metric names in
// docs/ledger.md).
type Stats struct {
	// Buffered is the number of events in memory (queued, being batched or
	// awaiting their ack): sluice_usage_buffer_depth.
	Buffered int64
	// BufferCapacity is the configured buffer size.
	BufferCapacity int64
	// SpoolBytes is the size of the spool on disk.
	SpoolBytes int64
	// Published counts events acknowledged by JetStream (including
	// replayed ones and duplicates JetStream dropped).
	Published int64
	// Messages counts JetStream messages acknowledged (a batch is one).
	Messages int64
	// Retries counts event publishes that failed and were retried.
	Retries int64
	// Spooled counts events written to the spool.
	Spooled int64
	// Replayed counts spooled events published.
	Replayed int64
	// Dropped counts events lost because neither the buffer nor the spool
	// could take them (each is logged with its request id).
	Dropped int64
}

type item struct {
	id   string
	data []byte
}

// message is one JetStream message: a single event or a batch.
type message struct {
	items []item
	data  []byte
	id    string // JetStream message id
	batch bool
	// buffered: the events came from the buffer (and count in inFlight
	// until acknowledged or spooled), not from the spool.
	buffered bool
	// err is why its last publish failed (nil: no answer in time).
	err error
}

func (m *message) natsMsg(subject string) *nats.Msg {
	msg := &nats.Msg{Subject: subject, Data: m.data}
	if m.batch {
		// A header per message: the publish adds the message id to it.
		msg.Header = nats.Header{wire.UsageEncodingHeader: []string{wire.UsageEncodingBatchV1}}
	}
	return msg
}

// sent is a message whose ack is awaited.
type sent struct {
	msg      *message
	f        jetstream.PubAckFuture // nil: the publish call itself failed
	deadline time.Time
	// state caches the outcome: a future's Ok and Err channels deliver
	// it once; err is the failure JetStream reported, if any.
	state ackState
	err   error
}

// Publisher buffers, spools and publishes usage events. Record is safe for
// concurrent use; Run must be called once.
type Publisher struct {
	cfg     Config
	nc      *nats.Conn
	js      jetstream.JetStream
	subject string
	log     *slog.Logger
	spool   *spool
	// tempSpool: the spool directory is a temporary one New created; an
	// empty one is removed at shutdown.
	tempSpool bool
	ch        chan item
	wake      chan struct{} // signalled when the spool gets data

	// batchPrefix + "-" + seq names a batch: unique per publisher (random)
	// and message (seq, drainer goroutine only).
	batchPrefix string
	seq         uint64

	// closeMu orders Record's buffer sends before the shutdown drain: after
	// closed is set under the write lock, nothing enters ch.
	closeMu sync.RWMutex
	closed  bool

	inFlight                                                 atomic.Int64 // events taken from ch, not yet acknowledged or spooled
	published, messages, retries, spooled, replayed, dropped atomic.Int64
}

// New returns a publisher that publishes through nc (which must stay open
// while Run runs) and opens the spool directory, creating it if needed.
func New(cfg Config, nc *nats.Conn) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.defaults()
	temp := cfg.SpoolDir == ""
	if temp {
		dir, err := os.MkdirTemp("", "sluice-usage-spool-")
		if err != nil {
			return nil, fmt.Errorf("usage spool directory: %w", err)
		}
		cfg.SpoolDir = dir
	}
	sp, err := openSpool(cfg.SpoolDir, cfg.SpoolMaxBytes)
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(cfg.AckTimeout),
		jetstream.WithPublishAsyncMaxPending(cfg.BatchSize+16))
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	var r [8]byte
	_, _ = rand.Read(r[:])
	return &Publisher{cfg: cfg, nc: nc, js: js, subject: wire.UsageSubject(cfg.Region), log: cfg.Logger, spool: sp, tempSpool: temp,
		ch: make(chan item, cfg.BufferSize), wake: make(chan struct{}, 1), batchPrefix: hex.EncodeToString(r[:])}, nil
}

// SpoolDir returns the spool directory in use.
func (p *Publisher) SpoolDir() string { return p.cfg.SpoolDir }

// Stats returns the current gauges and counters.
func (p *Publisher) Stats() Stats {
	return Stats{
		Buffered: int64(len(p.ch)) + p.inFlight.Load(), BufferCapacity: int64(p.cfg.BufferSize),
		SpoolBytes: p.spool.bytes.Load(), Published: p.published.Load(), Messages: p.messages.Load(),
		Retries: p.retries.Load(), Spooled: p.spooled.Load(), Replayed: p.replayed.Load(), Dropped: p.dropped.Load(),
	}
}

// Record queues ev for publishing. It never blocks on the network: it
// takes a buffer slot, or else appends to the spool (a local file write),
// or else counts and logs the event as dropped. ev must not be modified
// afterwards.
func (p *Publisher) Record(ev *usagev1.UsageEvent) {
	data, err := proto.Marshal(ev)
	if err != nil {
		p.drop(ev.GetRequestId(), fmt.Errorf("encode usage event: %w", err))
		return
	}
	it := item{id: ev.GetRequestId(), data: data}
	p.closeMu.RLock()
	if !p.closed {
		select {
		case p.ch <- it:
			p.closeMu.RUnlock()
			return
		default:
		}
	}
	p.closeMu.RUnlock()
	p.toSpool(it)
}

func (p *Publisher) toSpool(it item) {
	if err := p.spool.append(it.data); err != nil {
		p.drop(it.id, err)
		return
	}
	p.spooled.Add(1)
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *Publisher) drop(requestID string, err error) {
	p.dropped.Add(1)
	p.log.Error("usage event dropped: buffer full and spool unavailable", "request_id", requestID, "error", err)
}

// batchLimit is the most bytes one batch may have: BatchBytes, and within
// the server's max payload (less room for the subject and headers).
func (p *Publisher) batchLimit() int {
	limit := p.cfg.BatchBytes
	if mp := int(p.nc.MaxPayload()); mp > 0 {
		limit = min(limit, mp-4096)
	}
	return max(limit, 1)
}

// newMessage packs items (at least one) into a message.
func (p *Publisher) newMessage(items []item, buffered bool) *message {
	if p.cfg.BatchEvents <= 1 {
		return &message{items: items, data: items[0].data, id: items[0].id, buffered: buffered}
	}
	p.seq++
	id := p.batchPrefix + "-" + strconv.FormatUint(p.seq, 10)
	n := len(id) + 8
	for _, it := range items {
		n += batchEventOverhed + len(it.data)
	}
	b := make([]byte, 0, n)
	for _, it := range items {
		b = protowire.AppendTag(b, batchEventsField, protowire.BytesType)
		b = protowire.AppendBytes(b, it.data)
	}
	b = protowire.AppendTag(b, batchIDField, protowire.BytesType)
	b = protowire.AppendString(b, id)
	return &message{items: items, data: b, id: wire.UsageBatchMsgIDPrefix + id, batch: true, buffered: buffered}
}

// pack splits items into messages of at most BatchEvents events and
// batchLimit bytes.
func (p *Publisher) pack(items []item, buffered bool) []*message {
	var out []*message
	limit := p.batchLimit()
	start, size := 0, 0
	for i, it := range items {
		n := batchEventOverhed + len(it.data)
		if i > start && (i-start >= p.cfg.BatchEvents || size+n > limit) {
			out = append(out, p.newMessage(items[start:i:i], buffered))
			start, size = i, 0
		}
		size += n
	}
	if start < len(items) {
		out = append(out, p.newMessage(items[start:], buffered))
	}
	return out
}

// drainer is Run's state: the batch being filled and the messages whose
// ack is awaited, oldest first. Only the drainer goroutine touches it.
type drainer struct {
	cur      []item
	curBytes int
	curSince time.Time
	limit    int // batchLimit when cur got its first event
	window   []*sent
	inWindow int        // events in window
	pending  []*message // not acknowledged when Run stopped
	reader   *spoolReader
}

// room reports whether the ack window can take another event.
func (p *Publisher) room(d *drainer) bool { return len(d.cur)+d.inWindow < p.cfg.BatchSize }

// add puts an event taken from the buffer into the batch being filled,
// sending the batch first if the event would make it too big, and after
// if it is full.
func (p *Publisher) add(d *drainer, it item) {
	p.inFlight.Add(1)
	n := batchEventOverhed + len(it.data)
	if len(d.cur) > 0 && d.curBytes+n > d.limit {
		p.send(d)
	}
	if len(d.cur) == 0 {
		d.curSince = time.Now()
		d.limit = p.batchLimit()
	}
	d.cur = append(d.cur, it)
	d.curBytes += n
	if len(d.cur) >= p.cfg.BatchEvents {
		p.send(d)
	}
}

// Run drains the buffer and the spool until ctx is done, then flushes for
// at most FlushTimeout and spools whatever is left.
func (p *Publisher) Run(ctx context.Context) error {
	d := &drainer{}
	defer p.shutdown(d)
	linger, ackTimer := time.NewTimer(time.Hour), time.NewTimer(time.Hour)
	defer linger.Stop()
	defer ackTimer.Stop()
	for ctx.Err() == nil {
		// Take what the buffer holds, within the ack window.
	take:
		for p.room(d) {
			select {
			case it := <-p.ch:
				p.add(d, it)
			default:
				break take
			}
		}
		if len(d.cur) > 0 && time.Since(d.curSince) >= p.cfg.Linger {
			p.send(d)
		}
		if !p.reap(ctx, d) {
			continue // a failure was handled: look again
		}
		idle := len(d.cur) == 0 && len(d.window) == 0
		if idle && len(p.ch) == 0 && p.replay(ctx, d) {
			continue
		}
		// Wait for an event (if the window has room), the batch's linger,
		// the oldest ack, spooled data or a tick (to retry a spool file
		// that could not be read).
		var (
			in            <-chan item
			lingerC, ackC <-chan time.Time
			okC           <-chan *jetstream.PubAck
			errC          <-chan error
			wakeC         <-chan struct{}
			tick          <-chan time.Time
		)
		if p.room(d) {
			in = p.ch
		}
		if len(d.cur) > 0 {
			linger.Reset(time.Until(d.curSince.Add(p.cfg.Linger)))
			lingerC = linger.C
		}
		if len(d.window) > 0 {
			head := d.window[0] // reap left it waiting, so it has a future
			okC, errC = head.f.Ok(), head.f.Err()
			ackTimer.Reset(time.Until(head.deadline))
			ackC = ackTimer.C
		}
		if idle {
			wakeC = p.wake
			tick = time.After(time.Second)
		}
		select {
		case <-ctx.Done():
		case it := <-in:
			p.add(d, it)
		case <-lingerC:
		case <-okC:
			d.window[0].state = ackOK
		case err := <-errC:
			d.window[0].state, d.window[0].err = ackFailed, err
		case <-ackC:
		case <-wakeC:
		case <-tick:
		}
		stopTimer(linger)
		stopTimer(ackTimer)
	}
	return nil
}

func stopTimer(t *time.Timer) {
	if !t.Stop() {
		select {
		case <-t.C:
		default:
		}
	}
}

// send publishes the batch being filled asynchronously and adds it to the
// ack window.
func (p *Publisher) send(d *drainer) {
	m := p.newMessage(d.cur, true)
	d.cur, d.curBytes = nil, 0
	d.window = append(d.window, p.publishAsync(m))
	d.inWindow += len(m.items)
}

func (p *Publisher) publishAsync(m *message) *sent {
	s := &sent{msg: m, deadline: time.Now().Add(p.cfg.AckTimeout + time.Second)}
	f, err := p.js.PublishMsgAsync(m.natsMsg(p.subject), jetstream.WithMsgID(m.id))
	if err == nil {
		s.f = f
	}
	return s
}

// ackState is what became of a sent message.
type ackState int

const (
	ackWaiting ackState = iota
	ackOK
	ackFailed
)

func (s *sent) ack(now time.Time) ackState {
	if s.state != ackWaiting {
		return s.state
	}
	if s.f == nil {
		s.state = ackFailed
		return s.state
	}
	select {
	case <-s.f.Ok():
		s.state = ackOK
	case err := <-s.f.Err():
		s.state, s.err = ackFailed, err
	default:
		if now.After(s.deadline) {
			s.state = ackFailed
		}
	}
	return s.state
}

// settle waits until s is acknowledged, failed, past its deadline or ctx
// is done, and reports whether it was acknowledged.
func settle(ctx context.Context, s *sent) bool {
	if s.f != nil && s.state == ackWaiting {
		timer := time.NewTimer(time.Until(s.deadline))
		select {
		case <-s.f.Ok():
			s.state = ackOK
		case err := <-s.f.Err():
			s.state, s.err = ackFailed, err
		case <-timer.C:
		case <-ctx.Done():
		}
		timer.Stop()
	}
	return s.ack(time.Now()) == ackOK
}

func (p *Publisher) acked(m *message) {
	p.published.Add(int64(len(m.items)))
	p.messages.Add(1)
	if m.buffered {
		p.inFlight.Add(-int64(len(m.items)))
	}
}

// reap removes the acknowledged messages from the head of the window. On
// the first failure it waits for the whole window to settle and retries
// every failed message (same message ids) until JetStream has them or ctx
// is done, taking nothing new meanwhile; it then reports false.
func (p *Publisher) reap(ctx context.Context, d *drainer) bool {
	now := time.Now()
	for len(d.window) > 0 {
		st := d.window[0].ack(now)
		if st == ackWaiting {
			return true
		}
		if st == ackFailed {
			break
		}
		p.acked(d.window[0].msg)
		d.inWindow -= len(d.window[0].msg.items)
		d.window = d.window[1:]
	}
	if len(d.window) == 0 {
		d.window = nil
		return true
	}
	var failed []*message
	for _, s := range d.window {
		if settle(ctx, s) {
			p.acked(s.msg)
		} else {
			s.msg.err = s.err
			failed = append(failed, s.msg)
		}
	}
	d.window, d.inWindow = nil, 0
	if len(failed) > 0 {
		p.retries.Add(events(failed))
		d.pending = p.publish(ctx, failed, true)
	}
	return false
}

func events(msgs []*message) int64 {
	var n int64
	for _, m := range msgs {
		n += int64(len(m.items))
	}
	return n
}

// replay publishes the next chunk of the spool (the buffer is empty and
// nothing awaits an ack); it reports whether there was anything to do.
func (p *Publisher) replay(ctx context.Context, d *drainer) bool {
	if d.reader == nil {
		d.reader = p.nextSpoolFile()
	}
	if d.reader == nil {
		return false
	}
	batch, eof := p.replayChunk(d.reader)
	if len(batch) == 0 && !eof {
		return false
	}
	var left []*message
	if len(batch) > 0 {
		left = p.publish(ctx, p.pack(batch, false), false)
	}
	p.replayed.Add(int64(len(batch)) - events(left))
	if len(left) == 0 && eof {
		// Every frame of the file is acknowledged: remove it. (A crash
		// before this line replays the file again; JetStream's dedupe
		// window and the idempotent ledger absorb the copies.)
		d.reader.close()
		if err := os.Remove(d.reader.path); err != nil {
			p.log.Error("remove replayed usage spool file", "file", d.reader.path, "error", err)
		} else {
			p.spool.bytes.Add(-d.reader.size)
		}
		d.reader = nil
	}
	// Unacknowledged replayed events (ctx done) stay in their file, which
	// the next run replays.
	return true
}

// nextSpoolFile opens the oldest closed spool file, closing the active
// one first when no other is waiting; nil when the spool is empty.
func (p *Publisher) nextSpoolFile() *spoolReader {
	if p.spool.bytes.Load() == 0 {
		return nil
	}
	files, err := p.spool.files()
	if err == nil && len(files) == 0 {
		if err = p.spool.rotate(); err == nil {
			files, err = p.spool.files()
		}
	}
	if err != nil {
		p.log.Error("usage spool unreadable; spooled events wait", "dir", p.cfg.SpoolDir, "error", err)
		return nil
	}
	if len(files) == 0 {
		return nil
	}
	r, err := openSpoolReader(files[0])
	if err != nil {
		p.log.Error("usage spool file unreadable; spooled events wait", "file", files[0], "error", err)
		return nil
	}
	return r
}

// replayChunk reads up to BatchSize events from r; eof reports that the
// file has no more (a torn last frame, left by a crash mid-write, is
// counted as dropped and logged).
func (p *Publisher) replayChunk(r *spoolReader) (batch []item, eof bool) {
	for len(batch) < p.cfg.BatchSize {
		payload, err := r.next()
		switch {
		case err == nil:
			ev := &usagev1.UsageEvent{}
			if uerr := proto.Unmarshal(payload, ev); uerr != nil {
				p.drop("", fmt.Errorf("spooled usage event in %s does not decode: %w", r.path, uerr))
				continue
			}
			batch = append(batch, item{id: ev.GetRequestId(), data: payload})
		case errors.Is(err, io.EOF):
			return batch, true
		case errors.Is(err, errTornFrame):
			p.drop("", fmt.Errorf("%s: %w", r.path, err))
			return batch, true
		default:
			p.log.Error("read usage spool file; it is replayed later", "file", r.path, "error", err)
			return batch, false
		}
	}
	return batch, false
}

// publish sends msgs until every one is acknowledged or ctx is done; it
// returns the messages not acknowledged. failedOnce says the messages
// failed already: the first attempt then waits a backoff.
func (p *Publisher) publish(ctx context.Context, msgs []*message, failedOnce bool) []*message {
	backoff := p.cfg.MinBackoff
	attempt := 0
	if failedOnce {
		attempt = 1
		if !p.backoff(ctx, msgs, attempt, &backoff) {
			return msgs
		}
	}
	for {
		msgs = p.publishOnce(ctx, msgs)
		if len(msgs) == 0 {
			if attempt > 0 {
				p.log.Info("usage publishing recovered", "attempts", attempt+1)
			}
			return nil
		}
		attempt++
		p.retries.Add(events(msgs))
		if !p.backoff(ctx, msgs, attempt, &backoff) {
			return msgs
		}
	}
}

func (p *Publisher) backoff(ctx context.Context, msgs []*message, attempt int, backoff *time.Duration) bool {
	if attempt == 1 || attempt%20 == 0 {
		var cause error
		for _, m := range msgs {
			if m.err != nil {
				cause = m.err
				break
			}
		}
		p.log.Warn("usage publish failed; retrying", "events", events(msgs), "messages", len(msgs),
			"attempt", attempt, "retry_in_ms", backoff.Milliseconds(), "error", cause)
	}
	select {
	case <-ctx.Done():
		return false
	case <-time.After(*backoff):
	}
	*backoff = min(*backoff*2, p.cfg.MaxBackoff)
	return true
}

// publishOnce publishes msgs asynchronously, waits for the acks and
// returns the messages that failed.
func (p *Publisher) publishOnce(ctx context.Context, msgs []*message) []*message {
	window := make([]*sent, len(msgs))
	for i, m := range msgs {
		window[i] = p.publishAsync(m)
	}
	var failed []*message
	for _, s := range window {
		if settle(ctx, s) {
			p.acked(s.msg)
		} else {
			s.msg.err = s.err
			failed = append(failed, s.msg)
		}
	}
	return failed
}

// shutdown stops Record from using the buffer, flushes what is in memory
// for at most FlushTimeout and spools the rest.
func (p *Publisher) shutdown(d *drainer) {
	if d.reader != nil {
		d.reader.close() // replayed again by the next run
	}
	p.closeMu.Lock()
	p.closed = true
	p.closeMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.FlushTimeout)
	defer cancel()
	// Messages in the window: acknowledged, or published again below.
	var rest []*message
	for _, s := range d.window {
		if settle(ctx, s) {
			p.acked(s.msg)
		} else {
			rest = append(rest, s.msg)
		}
	}
	rest = append(rest, d.pending...)
	items := d.cur
	for {
		select {
		case it := <-p.ch:
			p.inFlight.Add(1)
			items = append(items, it)
			continue
		default:
		}
		break
	}
	rest = append(rest, p.pack(items, true)...)
	// Publish in chunks of about BatchSize events (the async publish
	// window), spooling what is not acknowledged in time.
	var left []*message
	for i := 0; i < len(rest); {
		if ctx.Err() != nil {
			left = append(left, rest[i:]...)
			break
		}
		j, n := i, 0
		for j < len(rest) && (j == i || n+len(rest[j].items) <= p.cfg.BatchSize) {
			n += len(rest[j].items)
			j++
		}
		left = append(left, p.publish(ctx, rest[i:j], false)...)
		i = j
	}
	for _, m := range left {
		for _, it := range m.items {
			p.toSpool(it)
		}
		if m.buffered {
			p.inFlight.Add(-int64(len(m.items)))
		}
	}
	if err := p.spool.rotate(); err != nil {
		p.log.Error("close usage spool", "error", err)
	}
	if n := p.spool.bytes.Load(); n > 0 {
		p.log.Warn("usage events remain in the spool; an instance started with the same --usage-spool-dir replays them",
			"dir", p.cfg.SpoolDir, "bytes", n)
	} else if p.tempSpool {
		// Nothing spooled: the temporary directory goes (a later Run
		// that spools creates it again).
		if err := os.RemoveAll(p.cfg.SpoolDir); err != nil {
			p.log.Warn("remove the empty usage spool directory", "dir", p.cfg.SpoolDir, "error", err)
		}
	}
}
