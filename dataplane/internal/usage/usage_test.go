package usage

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/internal/testsvc"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// syncBuffer is a goroutine-safe log sink.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// bundle is one test's NATS server (with the usage stream as the control
// plane creates it), a client connection and the captured logs.
type bundle struct {
	t    *testing.T
	nats *testsvc.NATSServer
	nc   *nats.Conn
	logs *syncBuffer
}

func setup(t *testing.T) *bundle {
	t.Helper()
	b := &bundle{t: t, nats: testsvc.StartNATS(t), logs: &syncBuffer{}}
	nc, err := nats.Connect(b.nats.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
		nats.RetryOnFailedConnect(true))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	b.nc = nc
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: wire.UsageStream, Subjects: []string{wire.UsageSubjectAll}, Storage: jetstream.FileStorage,
		Duplicates: 10 * time.Minute, MaxAge: 7 * 24 * time.Hour,
	})
	require.NoError(t, err)
	return b
}

func (b *bundle) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(b.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// start runs a publisher until the test ends (or stop is called) and
// returns it with its stop function, which waits for Run to return.
func (b *bundle) start(cfg Config) (*Publisher, func()) {
	b.t.Helper()
	if cfg.Region == "" {
		cfg.Region = "eu"
	}
	if cfg.Logger == nil {
		cfg.Logger = b.logger()
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff, cfg.MaxBackoff = 20*time.Millisecond, 200*time.Millisecond
	}
	if cfg.AckTimeout == 0 {
		cfg.AckTimeout = 500 * time.Millisecond
	}
	p, err := New(cfg, b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	b.t.Cleanup(stop)
	return p, stop
}

// streamMsgs returns the number of messages in the usage stream.
func (b *bundle) streamMsgs() uint64 {
	b.t.Helper()
	js, err := jetstream.New(b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, wire.UsageStream)
	if err != nil {
		return 0
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0
	}
	return info.State.Msgs
}

// streamIDs returns the request ids in the usage stream.
func (b *bundle) streamIDs() map[string]int {
	b.t.Helper()
	js, err := jetstream.New(b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := js.OrderedConsumer(ctx, wire.UsageStream, jetstream.OrderedConsumerConfig{})
	require.NoError(b.t, err)
	n := b.streamMsgs()
	out := map[string]int{}
	for i := uint64(0); i < n; i++ {
		m, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
		require.NoError(b.t, err)
		ev := &usagev1.UsageEvent{}
		require.NoError(b.t, proto.Unmarshal(m.Data(), ev))
		out[ev.GetRequestId()]++
	}
	return out
}

func event(i int) *usagev1.UsageEvent {
	return &usagev1.UsageEvent{RequestId: fmt.Sprintf("req_%06d", i), Time: timestamppb.Now(), Region: "eu",
		KeyId: "key_1", OrgId: "org_1", ModelGroup: "qwen", PromptTokens: int64(i), CompletionTokens: 2, CostUsd: 0.001,
		Status: 200}
}

func (b *bundle) waitMsgs(want uint64, within time.Duration) {
	b.t.Helper()
	require.Eventually(b.t, func() bool { return b.streamMsgs() == want }, within, 20*time.Millisecond,
		"usage stream has %d messages, want %d", b.streamMsgs(), want)
}

func TestPublishesEveryEventOnceByRequestID(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, _ := b.start(Config{})
	for i := range 500 {
		p.Record(event(i))
		if i%5 == 0 {
			p.Record(event(i)) // the same request again: JetStream dedupes it
		}
	}
	b.waitMsgs(500, 10*time.Second)
	ids := b.streamIDs()
	require.Len(t, ids, 500)
	for id, n := range ids {
		require.Equal(t, 1, n, id)
	}
	st := p.Stats()
	require.Equal(t, int64(600), st.Published, "every record acknowledged (duplicates too)")
	require.Zero(t, st.Spooled)
	require.Zero(t, st.Dropped)
}

func TestNATSDownEventsWaitInTheBufferAndArriveAfter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, _ := b.start(Config{})
	b.nats.Stop()
	for i := range 100 {
		p.Record(event(i))
	}
	require.Eventually(t, func() bool { return p.Stats().Retries > 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(100), p.Stats().Buffered, "events wait in memory")
	time.Sleep(300 * time.Millisecond) // a few failed rounds
	b.nats.Start()
	b.waitMsgs(100, 15*time.Second)
	require.Len(t, b.streamIDs(), 100)
	st := p.Stats()
	require.Zero(t, st.Dropped)
	require.Zero(t, st.Spooled)
	require.Eventually(t, func() bool { return p.Stats().Buffered == 0 }, 5*time.Second, 10*time.Millisecond)
}

func TestFullBufferSpoolsToDiskAndReplays(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dir := t.TempDir()
	p, _ := b.start(Config{BufferSize: 10, BatchSize: 4, SpoolDir: dir})
	b.nats.Stop()
	for i := range 300 {
		p.Record(event(i))
	}
	st := p.Stats()
	require.GreaterOrEqual(t, st.Spooled, int64(300-10-4), "beyond the buffer (and one batch in flight) events go to the spool")
	require.Zero(t, st.Dropped)
	require.Positive(t, st.SpoolBytes)
	files, _ := filepath.Glob(filepath.Join(dir, "*.spool"))
	require.NotEmpty(t, files)

	b.nats.Start()
	b.waitMsgs(300, 20*time.Second)
	ids := b.streamIDs()
	require.Len(t, ids, 300, "nothing lost")
	require.Eventually(t, func() bool { return p.Stats().SpoolBytes == 0 }, 5*time.Second, 10*time.Millisecond)
	st = p.Stats()
	require.Equal(t, st.Spooled, st.Replayed, "every spooled event replayed")
	require.Zero(t, st.Dropped)
	files, _ = filepath.Glob(filepath.Join(dir, "*.spool"))
	require.Empty(t, files, "replayed spool files are removed")
}

func TestShutdownSpoolsWhatRemainsAndTheNextInstanceReplaysIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dir := t.TempDir()
	p, stop := b.start(Config{SpoolDir: dir, FlushTimeout: 200 * time.Millisecond})
	b.nats.Stop()
	for i := range 50 {
		p.Record(event(i))
	}
	start := time.Now()
	stop()
	require.Less(t, time.Since(start), 3*time.Second, "shutdown flush is bounded")
	st := p.Stats()
	require.Equal(t, int64(50), st.Spooled, "what could not be flushed is spooled")
	require.Zero(t, st.Dropped)
	p.Record(event(50)) // after shutdown: straight to the spool
	require.Equal(t, int64(51), p.Stats().Spooled)

	b.nats.Start()
	p2, _ := b.start(Config{SpoolDir: dir})
	b.waitMsgs(51, 20*time.Second)
	require.Len(t, b.streamIDs(), 51)
	require.Eventually(t, func() bool { return p2.Stats().SpoolBytes == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(51), p2.Stats().Replayed)
}

// TestEmptyTemporarySpoolRemovedAtShutdown: without --usage-spool-dir the
// publisher spools to a temporary directory of its own, which it removes
// at shutdown when nothing is spooled there (an instance does not leave a
// directory behind at each start); an event recorded after shutdown is
// still spooled, the directory created again.
func TestEmptyTemporarySpoolRemovedAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, stop := b.start(Config{})
	dir := p.SpoolDir()
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.DirExists(t, dir)
	for i := range 10 {
		p.Record(event(i))
	}
	b.waitMsgs(10, 10*time.Second)
	stop()
	require.NoDirExists(t, dir, "the empty temporary spool is removed")
	p.Record(event(10)) // after shutdown: straight to the spool
	require.Equal(t, int64(1), p.Stats().Spooled)
	files, _ := filepath.Glob(filepath.Join(dir, "*.spool"))
	require.Len(t, files, 1, "nothing lost")
}

func TestSpoolUnavailableCountsAndLogsEachDrop(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p, _ := b.start(Config{BufferSize: 1, BatchSize: 1, SpoolDir: t.TempDir(), SpoolMaxBytes: 300})
	b.nats.Stop()
	for i := range 20 {
		p.Record(event(i))
	}
	// The drainer may be between taking an event off the buffer and
	// marking it in flight; the gauges settle within moments.
	var st Stats
	require.Eventually(t, func() bool {
		st = p.Stats()
		return st.Spooled+st.Dropped+st.Buffered == 20
	}, 2*time.Second, 5*time.Millisecond, "every event is buffered, spooled or counted as dropped: %+v", st)
	require.Positive(t, st.Spooled)
	require.Positive(t, st.Dropped)
	require.Contains(t, b.logs.String(), `"request_id":"req_000019"`, "a drop is logged with its request id")
	require.Contains(t, b.logs.String(), "usage event dropped")
}

func TestTornSpoolTailIsSkippedAndCounted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dir := t.TempDir()
	sp, err := openSpool(dir, 0)
	require.NoError(t, err)
	for i := range 5 {
		data, err := proto.Marshal(event(i))
		require.NoError(t, err)
		require.NoError(t, sp.append(data))
	}
	require.NoError(t, sp.rotate())
	files, _ := filepath.Glob(filepath.Join(dir, "*.spool"))
	require.Len(t, files, 1)
	f, err := os.OpenFile(files[0], os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.Write([]byte{0, 0, 0, 40, 1, 2, 3}) // a frame cut short by a crash
	require.NoError(t, err)
	require.NoError(t, f.Close())

	p, _ := b.start(Config{SpoolDir: dir})
	b.waitMsgs(5, 10*time.Second)
	require.Eventually(t, func() bool { return p.Stats().SpoolBytes == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(1), p.Stats().Dropped)
	require.Contains(t, b.logs.String(), "torn or corrupt frame")
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	c := Config{Region: "Bad Region", BufferSize: -1, SpoolMaxBytes: -1, AckTimeout: -1}
	err := c.Validate()
	require.Error(t, err)
	for _, want := range []string{"region", "buffer size", "spool size", "durations"} {
		require.Contains(t, err.Error(), want)
	}
}
