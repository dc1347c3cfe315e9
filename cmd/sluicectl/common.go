package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
)

// listPageSize is the page size list commands ask for (the server's
// maximum is 500).
const listPageSize = 200

// idCommand is a command taking one object id that prints one object
// (get, block, unblock, revoke).
func idCommand(name, noun, summary string, do func(ctx context.Context, c *clients, id string) (proto.Message, error), aliases ...string) *command {
	return oneArgCommand(name, noun+"_ID", summary, do, aliases...)
}

// oneArgCommand is a command taking one positional argument (an id or a
// name, arg in the usage) that prints one object.
func oneArgCommand(name, arg, summary string, do func(ctx context.Context, c *clients, id string) (proto.Message, error), aliases ...string) *command {
	return leaf(name, arg, summary, func(ctx context.Context, a *app, c *cmdArgs) error {
		pos, cl, p, err := a.parseConnect(a.flags(c), c, 1, 1)
		if err != nil {
			return err
		}
		obj, err := do(ctx, cl, pos[0])
		return p.result(obj, err)
	}, aliases...)
}

// deleteCommand deletes one object by id.
func deleteCommand(noun string, do func(ctx context.Context, c *clients, id string) (proto.Message, error)) *command {
	return deleteByCommand(noun, strings.ToUpper(noun)+"_ID", "delete a "+noun, do)
}

// deleteByCommand deletes one object by its positional argument (arg in
// the usage: an id or a name).
func deleteByCommand(noun, arg, summary string, do func(ctx context.Context, c *clients, id string) (proto.Message, error)) *command {
	return leaf("delete", arg, summary, func(ctx context.Context, a *app, c *cmdArgs) error {
		pos, cl, p, err := a.parseConnect(a.flags(c), c, 1, 1)
		if err != nil {
			return err
		}
		res, err := do(ctx, cl, pos[0])
		if err != nil {
			return err
		}
		if p.format != outTable {
			return p.message(res)
		}
		_, err = fmt.Fprintf(a.stdout, "Deleted %s %s.\n", noun, pos[0])
		return err
	}, "rm")
}

// limitFlag registers --limit, the most results a list command prints
// (0: all).
func limitFlag(fs *flag.FlagSet) *int {
	return fs.Int("limit", 0, "print at most `N` results (default: all, fetched page by page)")
}

// collect pages through a list call until the last page or limit items
// (limit 0: all).
func collect[T any](ctx context.Context, limit int, fetch func(ctx context.Context, size int32, token string) ([]T, string, error)) ([]T, error) {
	if limit < 0 {
		return nil, errors.New("--limit must not be negative")
	}
	var all []T
	tok := ""
	for {
		size := int32(listPageSize)
		if limit > 0 && limit-len(all) < listPageSize {
			size = int32(limit - len(all))
		}
		items, next, err := fetch(ctx, size, tok)
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
		if next == "" || (limit > 0 && len(all) >= limit) {
			break
		}
		if next == tok {
			return nil, fmt.Errorf("server returned the same page token twice (%q)", next)
		}
		tok = next
	}
	if limit > 0 && len(all) > limit {
		all = all[:limit]
	}
	return all, nil
}

// fetchPage fetches one page of a list; pos are the command's positional
// arguments.
type fetchPage[T any] func(ctx context.Context, c *clients, pos []string, size int32, token string) ([]T, string, error)

// listCommand is a list command: register adds the filter flags to fs and
// returns the page fetcher, which runs after parsing with the filters set.
func listCommand[T proto.Message](args string, summary string, cols []column[T], register func(fs *flag.FlagSet) fetchPage[T]) *command {
	nArgs := 0
	if args != "" {
		nArgs = 1
	}
	return leaf("list", args, summary, func(ctx context.Context, a *app, c *cmdArgs) error {
		fs := a.flags(c)
		limit := limitFlag(fs)
		mk := register(fs)
		pos, cl, p, err := a.parseConnect(fs, c, nArgs, nArgs)
		if err != nil {
			return err
		}
		items, err := collect(ctx, *limit, func(ctx context.Context, size int32, tok string) ([]T, string, error) {
			return mk(ctx, cl, pos, size, tok)
		})
		if err != nil {
			return err
		}
		return list(p, items, cols)
	}, "ls")
}

// nameArg takes an object's name from a positional argument or its flag,
// not both.
func nameArg(pos []string, flagVal *string, flagName string) error {
	if len(pos) == 0 {
		return nil
	}
	if *flagVal != "" && *flagVal != pos[0] {
		return fmt.Errorf("give the %s as an argument or as --%s, not both", flagName, flagName)
	}
	*flagVal = pos[0]
	return nil
}

// updateCommand is an update command of an object addressed by one id:
// register binds the object's settable fields (and --clear) to a fresh
// object, and do sends it with the update mask of the flags given.
func updateCommand[T proto.Message](noun string, newObj func() T, register func(f *fields, obj T), do func(ctx context.Context, c *clients, id string, obj T, mask *fieldmaskpb.FieldMask) (T, error)) *command {
	return leaf("update", strings.ToUpper(noun)+"_ID", "change the fields given as flags (--clear FLAG unsets one)", func(ctx context.Context, a *app, c *cmdArgs) error {
		fs := a.flags(c)
		obj := newObj()
		f := newFields(fs)
		register(f, obj)
		f.Clearable()
		pos, err := a.parse(fs, c, 1, 1)
		if err != nil {
			return err
		}
		mask, err := f.updateMask()
		if err != nil {
			return err
		}
		cl, p, err := a.connect()
		if err != nil {
			return err
		}
		res, err := do(ctx, cl, pos[0], obj, mask)
		return p.result(res, err)
	})
}

// renamed gives a generated command (a list command) another name and no
// aliases, for a second list under one group.
func renamed(name string, c *command) *command {
	c.name, c.aliases = name, nil
	return c
}

// parseConnect parses c's arguments with fs (between minArgs and maxArgs
// positional ones), then connects.
func (a *app) parseConnect(fs *flag.FlagSet, c *cmdArgs, minArgs, maxArgs int) ([]string, *clients, printer, error) {
	pos, err := a.parse(fs, c, minArgs, maxArgs)
	if err != nil {
		return nil, nil, printer{}, err
	}
	cl, p, err := a.connect()
	return pos, cl, p, err
}

// parseNamed parses the arguments of a create command whose object's
// name (or e-mail, issuer, ...) is an optional positional argument or the
// flag flagName bound to name (see nameArg).
func (a *app) parseNamed(fs *flag.FlagSet, c *cmdArgs, name *string, flagName string) error {
	pos, err := a.parse(fs, c, 0, 1)
	if err != nil {
		return err
	}
	return nameArg(pos, name, flagName)
}
