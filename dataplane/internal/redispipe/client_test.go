package redispipe

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// The machine's Redis (fails, not skips, when it is missing).
const redisAddr = "127.0.0.1:6379"

func prefix(t *testing.T) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "rp" + hex.EncodeToString(b[:]) + ":"
}

func newClient(t *testing.T, opts Options) *Client {
	t.Helper()
	if opts.Addr == "" {
		opts.Addr = redisAddr
	}
	c, err := New(opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestCommandsAndReplies(t *testing.T) {
	c := newClient(t, Options{})
	p := prefix(t)
	ctx := ctxT(t, 5*time.Second)

	v, err := c.Do(ctx, "SET", p+"a", "x y\r\nz")
	require.NoError(t, err)
	require.Equal(t, Value{Kind: '+', Str: "OK"}, v)
	v, err = c.Do(ctx, "GET", p+"a")
	require.NoError(t, err)
	require.Equal(t, Value{Kind: '$', Str: "x y\r\nz"}, v)
	v, err = c.Do(ctx, "GET", p+"missing")
	require.NoError(t, err)
	require.True(t, v.IsNil())
	v, err = c.Do(ctx, "INCRBY", p+"n", int64(-7))
	require.NoError(t, err)
	require.Equal(t, Value{Kind: ':', Int: -7}, v)
	v, err = c.Do(ctx, "RPUSH", p+"l", "a", 1, true)
	require.NoError(t, err)
	require.Equal(t, int64(3), v.Int)
	v, err = c.Do(ctx, "LRANGE", p+"l", 0, -1)
	require.NoError(t, err)
	require.Equal(t, []Value{{Kind: '$', Str: "a"}, {Kind: '$', Str: "1"}, {Kind: '$', Str: "1"}}, v.Arr)

	// An error reply is an Error; the connection stays usable.
	_, err = c.Do(ctx, "INCR", p+"a")
	var re Error
	require.ErrorAs(t, err, &re)
	require.True(t, HasPrefix(err, "ERR"), "%v", err)
	v, err = c.Do(ctx, "EXISTS", p+"a")
	require.NoError(t, err)
	require.Equal(t, int64(1), v.Int)

	// Nested arrays and an error inside an array.
	v, err = c.Eval(ctx, "return {1, {2, 'x'}, redis.error_reply('BAD thing')}", nil, nil, 0)
	require.NoError(t, err)
	require.Equal(t, Value{Kind: '*', Arr: []Value{
		{Kind: ':', Int: 1},
		{Kind: '*', Arr: []Value{{Kind: ':', Int: 2}, {Kind: '$', Str: "x"}}},
		{Kind: '-', Str: "BAD thing"},
	}}, v)

	// An argument of a type the client cannot encode is refused before
	// anything is sent.
	_, err = c.Do(ctx, "SET", p+"f", 1.5)
	require.ErrorContains(t, err, "unsupported type float64")
	v, err = c.Do(ctx, "EXISTS", p+"f")
	require.NoError(t, err)
	require.Equal(t, int64(0), v.Int)
}

func TestEvalShaAndNoScript(t *testing.T) {
	c := newClient(t, Options{})
	p := prefix(t)
	ctx := ctxT(t, 5*time.Second)
	src := "return {redis.call('INCRBY', KEYS[1], ARGV[1]), tonumber(ARGV[2])} -- " + p
	sha := redis.NewScript(src).Hash()

	raw := func(a string, b int64) []byte { return AppendBulkInt(AppendBulk(nil, a), b) }
	_, err := c.EvalSha(ctx, sha, []string{p + "k"}, raw("5", 9), 2)
	require.True(t, HasPrefix(err, "NOSCRIPT"), "%v", err)
	v, err := c.Eval(ctx, src, []string{p + "k"}, raw("5", 9), 2)
	require.NoError(t, err)
	got, err := v.Int64s()
	require.NoError(t, err)
	require.Equal(t, []int64{5, 9}, got)
	v, err = c.EvalSha(ctx, sha, []string{p + "k"}, raw("2", 0), 2)
	require.NoError(t, err)
	got, err = v.Int64s()
	require.NoError(t, err)
	require.Equal(t, []int64{7, 0}, got)

	_, err = Value{Kind: ':'}.Int64s()
	require.ErrorContains(t, err, "not an array")
	_, err = Value{Kind: '*', Arr: []Value{{Kind: '$'}}}.Int64s()
	require.ErrorContains(t, err, "element 0")
}

// Many goroutines share the connections: every call gets its own reply,
// and the commands of concurrent callers are coalesced into fewer writes.
func TestConcurrentCallsGetTheirOwnReplies(t *testing.T) {
	for _, conns := range []int{1, 3} {
		t.Run(fmt.Sprintf("conns=%d", conns), func(t *testing.T) {
			c := newClient(t, Options{Conns: conns})
			p := prefix(t)
			ctx := ctxT(t, 30*time.Second)
			const workers, each = 32, 300
			seen := make([]atomic.Bool, workers*each+1)
			var wg sync.WaitGroup
			var bad atomic.Int64
			for w := range workers {
				wg.Go(func() {
					key := fmt.Sprintf("%sw%d", p, w)
					for i := 1; i <= each; i++ {
						// Each worker's own counter must count 1, 2, 3…;
						// the shared one must hand out every value once.
						v, err := c.Do(ctx, "INCR", key)
						if err != nil || v.Int != int64(i) {
							bad.Add(1)
						}
						v, err = c.Do(ctx, "INCR", p+"shared")
						if err != nil || v.Int < 1 || v.Int > workers*each || seen[v.Int].Swap(true) {
							bad.Add(1)
						}
					}
				})
			}
			wg.Wait()
			require.Zero(t, bad.Load())
		})
	}
}

func TestDoMulti(t *testing.T) {
	c := newClient(t, Options{})
	p := prefix(t)
	ctx := ctxT(t, 5*time.Second)
	vals, errs := c.DoMulti(ctx, []Cmd{
		{Args: []any{"SET", p + "a", 1}},
		{Args: []any{"INCR", p + "a"}},
		{Args: []any{"HSET", p + "a", "f", 1}},
		{Args: []any{"GET", p + "a"}},
	})
	require.NoError(t, errs[0])
	require.Equal(t, "OK", vals[0].Str)
	require.NoError(t, errs[1])
	require.Equal(t, int64(2), vals[1].Int)
	require.True(t, HasPrefix(errs[2], "WRONGTYPE"), "%v", errs[2])
	require.NoError(t, errs[3])
	require.Equal(t, "2", vals[3].Str)

	vals, errs = c.DoMulti(ctx, nil)
	require.Empty(t, vals)
	require.Empty(t, errs)
	// An encoding error fails the whole batch before anything is sent.
	_, errs = c.DoMulti(ctx, []Cmd{{Args: []any{"SET", p + "b", 1}}, {Args: []any{"SET", p + "c", struct{}{}}}})
	require.ErrorContains(t, errs[0], "unsupported type")
	require.ErrorContains(t, errs[1], "unsupported type")
	v, err := c.Do(ctx, "EXISTS", p+"b")
	require.NoError(t, err)
	require.Equal(t, int64(0), v.Int)
}

func TestSelectDatabase(t *testing.T) {
	c := newClient(t, Options{DB: 3})
	p := prefix(t)
	ctx := ctxT(t, 5*time.Second)
	_, err := c.Do(ctx, "SET", p+"db", "three")
	require.NoError(t, err)
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr, DB: 3})
	defer rdb.Close()
	require.Equal(t, "three", rdb.Get(ctx, p+"db").Val())
	require.NoError(t, rdb.Del(ctx, p+"db").Err())
}

func TestDialRefusedIsADialError(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	c := newClient(t, Options{Addr: addr})
	_, err = c.Do(ctxT(t, time.Second), "PING")
	var de *DialError
	require.ErrorAs(t, err, &de)
}

// fakeServer is a RESP server scripted by the test: handle gets each
// command (as strings) and returns the raw reply to write, or "" to write
// nothing.
type fakeServer struct {
	l       net.Listener
	accepts atomic.Int64
	mu      sync.Mutex
	conns   []net.Conn
	errs    map[int64]error // the read error that ended connection n
}

func (f *fakeServer) readErr(n int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.errs[n]
}

func startFake(t *testing.T, handle func(n int64, cmd []string) string) *fakeServer {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &fakeServer{l: l, errs: map[int64]error{}}
	t.Cleanup(func() {
		_ = l.Close()
		f.mu.Lock()
		for _, c := range f.conns {
			_ = c.Close()
		}
		f.mu.Unlock()
	})
	go func() {
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			n := f.accepts.Add(1)
			f.mu.Lock()
			f.conns = append(f.conns, nc)
			f.mu.Unlock()
			go func() {
				br := bufio.NewReader(nc)
				for {
					v, err := readValue(br, 0)
					if err != nil {
						f.mu.Lock()
						f.errs[n] = err
						f.mu.Unlock()
						return
					}
					cmd := make([]string, len(v.Arr))
					for i, a := range v.Arr {
						cmd[i] = a.Str
					}
					if r := handle(n, cmd); r != "" {
						if _, err := nc.Write([]byte(r)); err != nil {
							return
						}
					}
				}
			}()
		}
	}()
	return f
}

func TestAuthOnEveryNewConnection(t *testing.T) {
	var got []string
	var mu sync.Mutex
	f := startFake(t, func(_ int64, cmd []string) string {
		mu.Lock()
		got = append(got, strings.Join(cmd, " "))
		mu.Unlock()
		switch cmd[0] {
		case "AUTH":
			if cmd[len(cmd)-1] != "s3cret" {
				return "-WRONGPASS invalid username-password pair\r\n"
			}
			return "+OK\r\n"
		case "SELECT":
			return "+OK\r\n"
		}
		return ":42\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String(), Username: "svc", Password: "s3cret", DB: 2})
	v, err := c.Do(ctxT(t, time.Second), "PING")
	require.NoError(t, err)
	require.Equal(t, int64(42), v.Int)
	mu.Lock()
	require.Equal(t, []string{"AUTH svc s3cret", "SELECT 2", "PING"}, got)
	mu.Unlock()

	bad := newClient(t, Options{Addr: f.l.Addr().String(), Password: "nope"})
	_, err = bad.Do(ctxT(t, time.Second), "PING")
	var de *DialError
	require.ErrorAs(t, err, &de)
	require.ErrorContains(t, err, "WRONGPASS")
}

// A server that stops answering: a call ends at its own deadline with a
// ConnError (the command may have run) and, the connection having been
// silent for AbortSilentAfter, resets it, so the server drops what it has
// not read; the next call dials again.
func TestFrozenServer(t *testing.T) {
	f := startFake(t, func(n int64, cmd []string) string {
		if n == 1 {
			return "" // the first connection never answers
		}
		return "+PONG\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String(), AbortSilentAfter: 30 * time.Millisecond})
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err := c.Do(ctx, "PING")
	cancel()
	var ce *ConnError
	require.ErrorAs(t, err, &ce)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(start), 250*time.Millisecond)
	require.Eventually(t, func() bool { return errors.Is(f.readErr(1), syscall.ECONNRESET) }, time.Second, 5*time.Millisecond,
		"the abandoned connection is reset, not closed")

	v, err := c.Do(ctxT(t, time.Second), "PING")
	require.NoError(t, err)
	require.Equal(t, "PONG", v.Str)
	require.Equal(t, int64(2), f.accepts.Load())
}

// A call that gives up before the connection was silent for
// AbortSilentAfter only abandons its reply: the connection stays.
func TestShortSilenceKeepsConnection(t *testing.T) {
	f := startFake(t, func(n int64, cmd []string) string {
		time.Sleep(80 * time.Millisecond)
		return ":" + cmd[1] + "\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String(), AbortSilentAfter: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	_, err := c.Do(ctx, "ECHO", 1)
	cancel()
	var ce *ConnError
	require.ErrorAs(t, err, &ce)
	v, err := c.Do(ctxT(t, 2*time.Second), "ECHO", 2)
	require.NoError(t, err)
	require.Equal(t, int64(2), v.Int)
	require.Equal(t, int64(1), f.accepts.Load())
}

// A server that answers, only late: a call that gives up is abandoned but
// the connection, still making progress, stays (other calls on it are not
// failed).
func TestSlowServerKeepsConnection(t *testing.T) {
	f := startFake(t, func(n int64, cmd []string) string {
		// The second call's answer comes well after its 45 ms deadline
		// however the goroutines are scheduled on a loaded machine.
		if cmd[1] == "2" {
			time.Sleep(300 * time.Millisecond)
		} else {
			time.Sleep(30 * time.Millisecond)
		}
		return ":" + cmd[1] + "\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String()})
	first := make(chan Value, 1)
	go func() {
		v, err := c.Do(ctxT(t, 2*time.Second), "ECHO", 1)
		if err != nil {
			t.Error(err)
		}
		first <- v
	}()
	require.Eventually(t, func() bool { return f.accepts.Load() == 1 }, time.Second, time.Millisecond)
	time.Sleep(5 * time.Millisecond) // the first call is queued
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Millisecond)
	_, err := c.Do(ctx, "ECHO", 2)
	cancel()
	var ce *ConnError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, int64(1), (<-first).Int)
	v, err := c.Do(ctxT(t, 2*time.Second), "ECHO", 3)
	require.NoError(t, err)
	require.Equal(t, int64(3), v.Int, "the abandoned reply (2) was dropped, not handed to the next call")
	require.Equal(t, int64(1), f.accepts.Load())
}

// A call with a long deadline behind which the server went silent: once
// its command waited StaleAfter, the next call replaces the connection.
func TestStaleConnectionIsReplaced(t *testing.T) {
	f := startFake(t, func(n int64, cmd []string) string {
		if n == 1 {
			return ""
		}
		return "+PONG\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String(), StaleAfter: 200 * time.Millisecond})
	first := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := c.Do(ctxT(t, 5*time.Second), "PING")
		first <- err
	}()
	require.Eventually(t, func() bool { return f.accepts.Load() == 1 }, time.Second, time.Millisecond)
	time.Sleep(250 * time.Millisecond)
	v, err := c.Do(ctxT(t, time.Second), "PING")
	require.NoError(t, err)
	require.Equal(t, "PONG", v.Str)
	err = <-first
	var ce *ConnError
	require.ErrorAs(t, err, &ce)
	require.Less(t, time.Since(start), 2*time.Second, "the stuck call ended with its connection, not at its deadline")
	require.Equal(t, int64(2), f.accepts.Load())
}

// A connection the server closes fails the calls waiting on it; the next
// call dials again.
func TestServerClosesConnection(t *testing.T) {
	var first atomic.Bool
	var f *fakeServer
	f = startFake(t, func(n int64, cmd []string) string {
		if n == 1 && first.CompareAndSwap(false, true) {
			f.mu.Lock()
			_ = f.conns[0].Close()
			f.mu.Unlock()
			return ""
		}
		return ":1\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String()})
	_, err := c.Do(ctxT(t, time.Second), "PING")
	var ce *ConnError
	require.ErrorAs(t, err, &ce)
	v, err := c.Do(ctxT(t, time.Second), "PING")
	require.NoError(t, err)
	require.Equal(t, int64(1), v.Int)
	require.Equal(t, int64(2), f.accepts.Load())
}

// Garbage from the server breaks the connection (a protocol error) and
// fails the call.
func TestProtocolError(t *testing.T) {
	f := startFake(t, func(n int64, cmd []string) string {
		if n == 1 {
			return "?what\r\n"
		}
		return ":7\r\n"
	})
	c := newClient(t, Options{Addr: f.l.Addr().String()})
	_, err := c.Do(ctxT(t, time.Second), "PING")
	require.ErrorIs(t, err, errProtocol)
	v, err := c.Do(ctxT(t, time.Second), "PING")
	require.NoError(t, err)
	require.Equal(t, int64(7), v.Int)
}

func TestClose(t *testing.T) {
	c := newClient(t, Options{})
	_, err := c.Do(ctxT(t, time.Second), "PING")
	require.NoError(t, err)
	require.NoError(t, c.Close())
	_, err = c.Do(ctxT(t, time.Second), "PING")
	require.ErrorIs(t, err, ErrClosed)
}

func TestParseURL(t *testing.T) {
	o, err := ParseURL("redis://u:p@h:6380/4")
	require.NoError(t, err)
	require.Equal(t, Options{Network: "tcp", Addr: "h:6380", Username: "u", Password: "p", DB: 4}, o)
	o, err = ParseURL("rediss://h")
	require.NoError(t, err)
	require.NotNil(t, o.TLSConfig)
	require.Equal(t, "h:6379", o.Addr)
	o, err = ParseURL("unix:///run/redis.sock?db=2")
	require.NoError(t, err)
	require.Equal(t, Options{Network: "unix", Addr: "/run/redis.sock", DB: 2}, o)
	_, err = ParseURL("redis://h/0?pool_size=10")
	require.ErrorContains(t, err, `option "pool_size" is not supported`)
	_, err = ParseURL("http://h")
	require.Error(t, err)

	_, err = New(Options{})
	require.ErrorContains(t, err, "address is required")
	_, err = New(Options{Addr: "x", Conns: 65})
	require.ErrorContains(t, err, "1–64")
	_, err = New(Options{Addr: "x", Network: "udp"})
	require.ErrorContains(t, err, "want tcp or unix")
}

// TestEndedContextIsNotSent: a call whose context has already ended gets a
// DialError and its command never reaches Redis, even on a live connection
// whose reply would arrive at once (before, the reply could win the race
// with ctx.Done, and an expired call was answered).
func TestEndedContextIsNotSent(t *testing.T) {
	c := newClient(t, Options{})
	p := prefix(t)
	ctx := ctxT(t, 5*time.Second)
	_, err := c.Do(ctx, "PING") // the connection is live
	require.NoError(t, err)
	ended, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	for i := range 200 {
		_, err := c.Do(ended, "INCR", p+"n")
		var de *DialError
		require.ErrorAs(t, err, &de, "call %d", i)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		_, errs := c.DoMulti(ended, []Cmd{{Args: []any{"INCR", p + "n"}}})
		require.ErrorAs(t, errs[0], &de, "call %d", i)
	}
	v, err := c.Do(ctx, "EXISTS", p+"n")
	require.NoError(t, err)
	require.Equal(t, int64(0), v.Int, "no INCR was sent")
}
