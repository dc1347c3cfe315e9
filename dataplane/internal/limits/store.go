package limits

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
)

// script is one embedded script with its SHA.
type script struct {
	src string
	rs  *redis.Script
}

func newScript(src string) *script { return &script{src: src, rs: redis.NewScript(src)} }

func (s *script) sha() string { return s.rs.Hash() }

// scriptCall is one call of a script.
type scriptCall struct {
	keys []string
	args *argv
}

// argv is a script call's ARGV, encoded as RESP bulk strings as it is
// built: no boxing of integers, no intermediate strings. Buffers are
// pooled (release after the call).
type argv struct {
	b []byte
	n int
}

var argvPool = sync.Pool{New: func() any { return &argv{b: make([]byte, 0, 1024)} }}

func newArgv() *argv { return argvPool.Get().(*argv) }

func (a *argv) release() {
	if cap(a.b) <= 64<<10 {
		a.b, a.n = a.b[:0], 0
		argvPool.Put(a)
	}
}

func (a *argv) int(v int64) { a.b = redispipe.AppendBulkInt(a.b, v); a.n++ }

func (a *argv) str(v string) { a.b = redispipe.AppendBulk(a.b, v); a.n++ }

func (a *argv) bool(v bool) {
	if v {
		a.int(1)
	} else {
		a.int(0)
	}
}

// strings decodes the arguments (for go-redis, off the single-Redis hot
// path).
func (a *argv) strings() []any {
	out := make([]any, 0, a.n)
	b := a.b
	for len(b) > 0 {
		// "$<len>\r\n<data>\r\n"
		i := bytes.IndexByte(b, '\r')
		n, _ := strconv.Atoi(string(b[1:i]))
		out = append(out, string(b[i+2:i+2+n]))
		b = b[i+2+n+2:]
	}
	return out
}

// store is the Redis the limiter runs its scripts on: the pipelining client
// of the request path (redispipe, one Redis) or go-redis (Redis Cluster,
// and any redis.Scripter). Every error it returns is wrapped by the
// caller as ErrUnavailable.
type store interface {
	// eval runs s: EVALSHA, then EVAL when Redis does not have the script
	// (after a restart or SCRIPT FLUSH).
	eval(ctx context.Context, s *script, c scriptCall) ([]int64, error)
	// evalBatch runs s for every call in one pipelined round trip; results
	// and errors are per call (a call failing with NOSCRIPT is retried
	// through eval).
	evalBatch(ctx context.Context, s *script, calls []scriptCall) ([][]int64, []error)
	// setNX sets key to v unless it exists.
	setNX(ctx context.Context, key string, v int64) error
	// ping checks that Redis answers (every master of a cluster): the
	// slice worker's heartbeat (slices.go).
	ping(ctx context.Context) error
}

// goRedisStore runs scripts through go-redis (Script.Run, pipelines).
type goRedisStore struct{ c redis.Scripter }

func (g goRedisStore) eval(ctx context.Context, s *script, c scriptCall) ([]int64, error) {
	raw, err := s.rs.Run(ctx, g.c, c.keys, c.args.strings()...).Slice()
	if err != nil {
		return nil, err
	}
	return int64s(raw)
}

func (g goRedisStore) evalBatch(ctx context.Context, s *script, calls []scriptCall) ([][]int64, []error) {
	res := make([][]int64, len(calls))
	errs := make([]error, len(calls))
	pl, ok := g.c.(interface{ Pipeline() redis.Pipeliner })
	if !ok || len(calls) == 1 {
		for i, c := range calls {
			res[i], errs[i] = g.eval(ctx, s, c)
		}
		return res, errs
	}
	pipe := pl.Pipeline()
	cmds := make([]*redis.Cmd, len(calls))
	for i, c := range calls {
		cmds[i] = s.rs.EvalSha(ctx, pipe, c.keys, c.args.strings()...)
	}
	_, _ = pipe.Exec(ctx)
	for i, cmd := range cmds {
		raw, err := cmd.Slice()
		switch {
		case err != nil && redis.HasErrorPrefix(err, "NOSCRIPT"):
			res[i], errs[i] = g.eval(ctx, s, calls[i])
		case err != nil:
			errs[i] = err
		default:
			res[i], errs[i] = int64s(raw)
		}
	}
	return res, errs
}

func (g goRedisStore) setNX(ctx context.Context, key string, v int64) error {
	c, ok := g.c.(redis.Cmdable)
	if !ok {
		return errors.New("client cannot run SET")
	}
	return c.SetNX(ctx, key, v, 0).Err()
}

func (g goRedisStore) ping(ctx context.Context) error {
	if cc, ok := g.c.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.Ping(ctx).Err() })
	}
	c, ok := g.c.(redis.Cmdable)
	if !ok {
		return errors.New("client cannot run PING")
	}
	return c.Ping(ctx).Err()
}

// pipeStore runs scripts through redispipe: concurrent calls share writes
// and reads (see package redispipe for why the request path uses it).
type pipeStore struct{ c *redispipe.Client }

func (p pipeStore) eval(ctx context.Context, s *script, c scriptCall) ([]int64, error) {
	v, err := p.c.EvalSha(ctx, s.sha(), c.keys, c.args.b, c.args.n)
	if err != nil && redispipe.HasPrefix(err, "NOSCRIPT") {
		v, err = p.c.Eval(ctx, s.src, c.keys, c.args.b, c.args.n)
	}
	if err != nil {
		return nil, err
	}
	return v.Int64s()
}

func (p pipeStore) evalBatch(ctx context.Context, s *script, calls []scriptCall) ([][]int64, []error) {
	cmds := make([]redispipe.Cmd, len(calls))
	for i, c := range calls {
		cmds[i] = redispipe.EvalShaCmd(s.sha(), c.keys, c.args.b, c.args.n)
	}
	vals, errs := p.c.DoMulti(ctx, cmds)
	res := make([][]int64, len(calls))
	for i := range calls {
		if errs[i] != nil && redispipe.HasPrefix(errs[i], "NOSCRIPT") {
			res[i], errs[i] = p.eval(ctx, s, calls[i])
			continue
		}
		if errs[i] == nil {
			res[i], errs[i] = vals[i].Int64s()
		}
	}
	return res, errs
}

func (p pipeStore) setNX(ctx context.Context, key string, v int64) error {
	_, err := p.c.Do(ctx, "SET", key, v, "NX")
	return err
}

func (p pipeStore) ping(ctx context.Context) error {
	_, err := p.c.Do(ctx, "PING")
	return err
}
