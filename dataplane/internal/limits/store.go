package limits

import (
	"context"
	"errors"

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

// scriptCall is one call of a script in a batch.
type scriptCall struct {
	keys []string
	args []any
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
}

// goRedisStore runs scripts through go-redis (Script.Run, pipelines).
type goRedisStore struct{ c redis.Scripter }

func (g goRedisStore) eval(ctx context.Context, s *script, c scriptCall) ([]int64, error) {
	raw, err := s.rs.Run(ctx, g.c, c.keys, c.args...).Slice()
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
		cmds[i] = s.rs.EvalSha(ctx, pipe, c.keys, c.args...)
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

// pipeStore runs scripts through redispipe: concurrent calls share writes
// and reads (see package redispipe for why the request path uses it).
type pipeStore struct{ c *redispipe.Client }

func (p pipeStore) eval(ctx context.Context, s *script, c scriptCall) ([]int64, error) {
	v, err := p.c.EvalSha(ctx, s.sha(), c.keys, c.args)
	if err != nil && redispipe.HasPrefix(err, "NOSCRIPT") {
		v, err = p.c.Eval(ctx, s.src, c.keys, c.args)
	}
	if err != nil {
		return nil, err
	}
	return v.Int64s()
}

func (p pipeStore) evalBatch(ctx context.Context, s *script, calls []scriptCall) ([][]int64, []error) {
	cmds := make([]redispipe.Cmd, len(calls))
	for i, c := range calls {
		cmds[i] = redispipe.EvalShaCmd(s.sha(), c.keys, c.args)
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
