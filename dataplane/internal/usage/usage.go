// Package usage publishes the data plane's usage events (one per request,
// SPEC §9.2) to JetStream, off the request path, without losing them.
//
// Record puts an event in a bounded in-memory buffer and returns at once.
// One drainer goroutine (Run) publishes the buffer in batches to the
// region's usage subject with the request id as JetStream dedupe id, and
// waits for every ack; failed publishes are retried with backoff for as
// long as NATS is away. When the buffer is full, Record appends the event
// to an on-disk spool instead, which the drainer replays once the buffer
// has drained. Only when the spool cannot take the event either (disk
// error, spool size limit) is the event dropped: it is then counted
// (sluice_usage_dropped_total) and logged at error level with its request
// id. On shutdown the drainer flushes for a bounded time and spools what
// remains. docs/ledger.md describes the policy.
package usage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Defaults.
const (
	// DefaultBufferSize is the in-memory buffer, in events: at 1 KiB an
	// event about 10 MiB, and several seconds of a busy proxy's traffic.
	DefaultBufferSize = 10_000
	// DefaultBatchSize is how many events one publish round sends before
	// waiting for their acks.
	DefaultBatchSize = 256
	// DefaultAckTimeout bounds the wait for a publish ack.
	DefaultAckTimeout = 5 * time.Second
	// DefaultMinBackoff and DefaultMaxBackoff bound the wait between
	// publish retries while NATS is unreachable.
	DefaultMinBackoff = 100 * time.Millisecond
	DefaultMaxBackoff = 5 * time.Second
	// DefaultLinger is how long the drainer, woken by the first event after
	// a quiet spell, waits before taking the buffer: a lightly loaded proxy
	// then publishes several events per round (one socket write, one
	// wakeup) instead of one. Under load the buffer is never empty and the
	// drainer does not wait.
	DefaultLinger = time.Millisecond
	// DefaultFlushTimeout bounds the flush at shutdown.
	DefaultFlushTimeout = 5 * time.Second
	// DefaultSpoolMaxBytes bounds the spool on disk (1 GiB, about a
	// million events).
	DefaultSpoolMaxBytes = 1 << 30
)

// Config configures a Publisher.
type Config struct {
	// Region names the usage subject (wire.UsageSubject).
	Region string
	// BufferSize is the in-memory buffer in events (DefaultBufferSize if 0).
	BufferSize int
	// SpoolDir is where events go when the buffer is full. Empty: a new
	// temporary directory per instance (events spooled there at shutdown
	// are not replayed by the next instance; set a persistent directory
	// for that).
	SpoolDir string
	// SpoolMaxBytes bounds the spool (DefaultSpoolMaxBytes if 0).
	SpoolMaxBytes int64
	// BatchSize, AckTimeout, MinBackoff, MaxBackoff, Linger and
	// FlushTimeout tune publishing (defaults above when 0).
	BatchSize    int
	Linger       time.Duration
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
	// Buffered is the number of events in memory (queued or being
	// published): sluice_usage_buffer_depth.
	Buffered int64
	// BufferCapacity is the configured buffer size.
	BufferCapacity int64
	// SpoolBytes is the size of the spool on disk.
	SpoolBytes int64
	// Published counts events acknowledged by JetStream (including
	// replayed ones and duplicates JetStream dropped).
	Published int64
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

// Publisher buffers, spools and publishes usage events. Record is safe for
// concurrent use; Run must be called once.
type Publisher struct {
	cfg     Config
	js      jetstream.JetStream
	subject string
	log     *slog.Logger
	spool   *spool
	ch      chan item
	wake    chan struct{} // signalled when the spool gets data

	// closeMu orders Record's buffer sends before the shutdown drain: after
	// closed is set under the write lock, nothing enters ch.
	closeMu sync.RWMutex
	closed  bool

	inFlight                                                  atomic.Int64
	published, retries, spooled, replayed, dropped, replayErr atomic.Int64
}

// New returns a publisher that publishes through nc (which must stay open
// while Run runs) and opens the spool directory, creating it if needed.
func New(cfg Config, nc *nats.Conn) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.defaults()
	if cfg.SpoolDir == "" {
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
		jetstream.WithPublishAsyncMaxPending(4*cfg.BatchSize))
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Publisher{cfg: cfg, js: js, subject: wire.UsageSubject(cfg.Region), log: cfg.Logger, spool: sp,
		ch: make(chan item, cfg.BufferSize), wake: make(chan struct{}, 1)}, nil
}

// SpoolDir returns the spool directory in use.
func (p *Publisher) SpoolDir() string { return p.cfg.SpoolDir }

// Stats returns the current gauges and counters.
func (p *Publisher) Stats() Stats {
	return Stats{
		Buffered: int64(len(p.ch)) + p.inFlight.Load(), BufferCapacity: int64(p.cfg.BufferSize),
		SpoolBytes: p.spool.bytes.Load(), Published: p.published.Load(), Retries: p.retries.Load(),
		Spooled: p.spooled.Load(), Replayed: p.replayed.Load(), Dropped: p.dropped.Load(),
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

// Run drains the buffer and the spool until ctx is done, then flushes for
// at most FlushTimeout and spools whatever is left.
func (p *Publisher) Run(ctx context.Context) error {
	var (
		reader  *spoolReader // spool file being replayed
		pending []item       // unpublished events from the buffer
	)
	defer func() {
		if reader != nil {
			reader.close() // replayed again by the next run
		}
		p.shutdown(pending)
	}()
	for ctx.Err() == nil {
		// The buffer first: it holds the newest events and Record's only
		// fast path. The spool is replayed when the buffer is empty.
		batch := p.take(nil)
		fromSpool, eof := false, false
		if len(batch) == 0 {
			if reader == nil {
				reader = p.nextSpoolFile()
			}
			if reader != nil {
				batch, eof = p.replayChunk(reader)
				fromSpool = true
			}
		}
		if len(batch) == 0 && !eof {
			// Nothing to do: wait for an event, spooled data or a tick
			// (to retry a spool file that could not be read).
			select {
			case <-ctx.Done():
			case it := <-p.ch:
				batch = p.linger(ctx, []item{it})
			case <-p.wake:
			case <-time.After(time.Second):
			}
		}
		p.inFlight.Store(int64(len(batch)))
		left := p.publish(ctx, batch)
		p.inFlight.Store(0)
		if !fromSpool {
			pending = left
			continue
		}
		p.replayed.Add(int64(len(batch) - len(left)))
		if len(left) == 0 && eof {
			// Every frame of the file is acknowledged: remove it. (A crash
			// before this line replays the file again; JetStream's dedupe
			// window and the idempotent ledger absorb the copies.)
			reader.close()
			if err := os.Remove(reader.path); err != nil {
				p.log.Error("remove replayed usage spool file", "file", reader.path, "error", err)
			} else {
				p.spool.bytes.Add(-reader.size)
			}
			reader = nil
		}
	}
	return nil
}

// take appends up to BatchSize buffered events to batch without blocking.
func (p *Publisher) take(batch []item) []item {
	for len(batch) < p.cfg.BatchSize {
		select {
		case it := <-p.ch:
			batch = append(batch, it)
		default:
			return batch
		}
	}
	return batch
}

// linger waits Linger (or until ctx is done), then takes what the buffer
// gathered meanwhile.
func (p *Publisher) linger(ctx context.Context, batch []item) []item {
	t := time.NewTimer(p.cfg.Linger)
	select {
	case <-ctx.Done():
	case <-t.C:
	}
	t.Stop()
	return p.take(batch)
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

// publish sends batch until every event is acknowledged or ctx is done;
// it returns the events not acknowledged.
func (p *Publisher) publish(ctx context.Context, batch []item) []item {
	backoff := p.cfg.MinBackoff
	attempt := 0
	for {
		batch = p.publishOnce(ctx, batch)
		if len(batch) == 0 {
			if attempt > 0 {
				p.log.Info("usage publishing recovered", "attempts", attempt+1)
			}
			return nil
		}
		attempt++
		p.retries.Add(int64(len(batch)))
		if attempt == 1 || attempt%20 == 0 {
			p.log.Warn("usage publish failed; retrying", "events", len(batch), "attempt", attempt, "retry_in_ms", backoff.Milliseconds())
		}
		select {
		case <-ctx.Done():
			return batch
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, p.cfg.MaxBackoff)
	}
}

// publishOnce publishes batch asynchronously, waits for the acks and
// returns the events that failed.
func (p *Publisher) publishOnce(ctx context.Context, batch []item) []item {
	futures := make([]jetstream.PubAckFuture, len(batch))
	for i, it := range batch {
		f, err := p.js.PublishMsgAsync(&nats.Msg{Subject: p.subject, Data: it.data}, jetstream.WithMsgID(it.id))
		if err == nil {
			futures[i] = f
		}
	}
	var failed []item
	deadline := time.NewTimer(p.cfg.AckTimeout + time.Second)
	defer deadline.Stop()
	expired := false
	for i, f := range futures {
		if f == nil || expired {
			failed = append(failed, batch[i])
			continue
		}
		select {
		case <-f.Ok():
			p.published.Add(1)
		case <-f.Err():
			failed = append(failed, batch[i])
		case <-deadline.C:
			expired = true
			failed = append(failed, batch[i])
		case <-ctx.Done():
			expired = true
			failed = append(failed, batch[i])
		}
	}
	return failed
}

// shutdown stops Record from using the buffer, flushes buffered events
// for at most FlushTimeout and spools the rest.
func (p *Publisher) shutdown(pending []item) {
	p.closeMu.Lock()
	p.closed = true
	p.closeMu.Unlock()
	for {
		select {
		case it := <-p.ch:
			pending = append(pending, it)
			continue
		default:
		}
		break
	}
	if len(pending) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.FlushTimeout)
		var rest []item
		for i := 0; i < len(pending); i += p.cfg.BatchSize {
			if ctx.Err() != nil {
				rest = append(rest, pending[i:]...)
				break
			}
			rest = append(rest, p.publish(ctx, pending[i:min(i+p.cfg.BatchSize, len(pending))])...)
		}
		cancel()
		pending = rest
	}
	for _, it := range pending {
		p.toSpool(it)
	}
	if err := p.spool.rotate(); err != nil {
		p.log.Error("close usage spool", "error", err)
	}
	if n := p.spool.bytes.Load(); n > 0 {
		p.log.Warn("usage events remain in the spool; an instance started with the same --usage-spool-dir replays them",
			"dir", p.cfg.SpoolDir, "bytes", n)
	}
}
