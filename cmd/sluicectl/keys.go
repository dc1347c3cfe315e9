package main

import (
	"context"
	"flag"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var keyColumns = []column[*adminv1.Key]{
	{"ID", (*adminv1.Key).GetId},
	{"ALIAS", (*adminv1.Key).GetAlias},
	{"TOKEN", func(k *adminv1.Key) string { return tokenHint(k.GetDisplayPrefix(), k.GetLast4()) }},
	{"TEAM", (*adminv1.Key).GetTeamId},
	{"USER", (*adminv1.Key).GetUserId},
	{"CLASS", func(k *adminv1.Key) string { return trafficClass(k.GetTrafficClass()) }},
	{"BLOCKED", func(k *adminv1.Key) string { return yesNo(k.GetBlocked()) }},
	{"EXPIRES", func(k *adminv1.Key) string { return formatTime(k.GetExpireTime()) }},
	{"LIMITS", func(k *adminv1.Key) string { return limitsSummary(k.GetLimits()) }},
}

// tokenHint shows a stored token's visible parts: "sk-sluice-AbCd…wxyz".
func tokenHint(prefix, last4 string) string {
	if prefix == "" && last4 == "" {
		return ""
	}
	return prefix + "…" + last4
}

// keyFields registers the settable fields of a key (its org and team
// never change, so --org and --team are create-only flags).
func keyFields(f *fields, k *adminv1.Key) {
	f.String(&k.UserId, "user", "user_id", "owner user id; the user's limits apply to the key")
	f.String(&k.Project, "project", "project", "project name, for attribution")
	f.String(&k.Alias, "alias", "alias", "human-readable name")
	f.Time(&k.ExpireTime, "expires", "expire_time", "expiry: RFC 3339 time, a date, or a duration from now (30d, 12h); never: no expiry")
	f.List(&k.Tags, "tags", "tags", "tags, comma-separated (repeatable)")
	f.TrafficClass(&k.TrafficClass, "traffic-class", "traffic_class", "interactive, agent or batch (default: the team's)")
	f.Map(&k.ModelGroupAliases, "model-group-alias", "model_group_aliases", "requested model → model group, `REQUESTED=GROUP` (repeatable; on update it replaces the map)")
	f.List(&k.EnforcedParams, "enforced-params", "enforced_params", "request body parameters clients must send, comma-separated (e.g. user,metadata.generation_name)")
	f.List(&k.AllowedRoutes, "allowed-routes", "allowed_routes", "proxy routes the key may call, comma-separated (e.g. /v1/chat/completions); empty: all")
	f.Limits(&k.Limits, limitsPerModel)
	f.Metadata(&k.Metadata)
	f.Fallbacks(&k.Fallbacks, "fallbacks", "fallbacks", "fallback model groups of a group for this key, `GROUP=FB1,FB2` (repeatable; GROUP= turns them off; on update it replaces the map)")
}

func keyCommand() *command {
	return group("key", "manage virtual keys", []*command{
		leaf("create", "", "create a key; its token is printed once", runKeyCreate),
		idCommand("get", "KEY", "show a key", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.keys.GetKey, &adminv1.GetKeyRequest{Id: id})
			return r.GetKey(), err
		}),
		listCommand("", "list keys", keyColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.Key] {
			req := &adminv1.ListKeysRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only keys of this org")
			fs.StringVar(&req.TeamId, "team", "", "only keys of this team")
			fs.StringVar(&req.UserId, "user", "", "only keys owned by this user")
			fs.StringVar(&req.AliasPrefix, "alias-prefix", "", "only keys whose alias starts with this")
			fs.StringVar(&req.Tag, "tag", "", "only keys with this tag")
			fs.Var(&optBool{&req.Blocked}, "blocked", "only blocked (--blocked) or unblocked (--blocked=false) keys")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.Key, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.keys.ListKeys, req)
				return r.GetKeys(), r.GetNextPageToken(), err
			}
		}),
		updateCommand("key", func() *adminv1.Key { return &adminv1.Key{} }, keyFields,
			func(ctx context.Context, c *clients, id string, o *adminv1.Key, mask *fieldmaskpb.FieldMask) (*adminv1.Key, error) {
				o.Id = id
				r, err := call(ctx, c.keys.UpdateKey, &adminv1.UpdateKeyRequest{Key: o, UpdateMask: mask})
				return r.GetKey(), err
			}),
		deleteCommand("key", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.keys.DeleteKey, &adminv1.DeleteKeyRequest{Id: id})
		}),
		leaf("rotate", "KEY_ID", "issue a new token for the key (spend and windows are kept); printed once", runKeyRotate, "regenerate"),
		idCommand("block", "KEY", "block a key: its token is rejected (403)", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.keys.BlockKey, &adminv1.BlockKeyRequest{Id: id})
			return r.GetKey(), err
		}),
		idCommand("unblock", "KEY", "unblock a key", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.keys.UnblockKey, &adminv1.UnblockKeyRequest{Id: id})
			return r.GetKey(), err
		}),
	}, "keys")
}

func runKeyCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	k := &adminv1.Key{}
	fs.StringVar(&k.OrgId, "org", "", "org of the key (default: the token's org; required with a platform token)")
	fs.StringVar(&k.TeamId, "team", "", "team of the key (default: the token's team for team tokens)")
	keyFields(newFields(fs), k)
	_, cl, p, err := a.parseConnect(fs, c, 0, 0)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.keys.CreateKey, &adminv1.CreateKeyRequest{
		OrgId: k.OrgId, TeamId: k.TeamId, UserId: k.UserId, Project: k.Project, Alias: k.Alias,
		ExpireTime: k.ExpireTime, Tags: k.Tags, TrafficClass: k.TrafficClass,
		ModelGroupAliases: k.ModelGroupAliases, EnforcedParams: k.EnforcedParams,
		AllowedRoutes: k.AllowedRoutes, Limits: k.Limits, Metadata: k.Metadata, Fallbacks: k.Fallbacks,
	})
	if err != nil {
		return err
	}
	a.warnSecret("key token")
	return p.one(r, r.GetKey(), [2]string{"token", r.GetToken()})
}

func runKeyRotate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	grace := fs.String("grace", "", "how long the old token stays valid (90s, 15m, 24h, 7d; at most 30d); default: invalid at once")
	pos, cl, p, err := a.parseConnect(fs, c, 1, 1)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.keys.RotateKey, &adminv1.RotateKeyRequest{Id: pos[0], GracePeriod: *grace})
	if err != nil {
		return err
	}
	a.warnSecret("key token")
	valid := "no longer valid"
	if r.GetOldTokenValidUntil() != nil {
		valid = formatTime(r.GetOldTokenValidUntil())
	}
	return p.one(r, r.GetKey(), [2]string{"old_token_valid_until", valid}, [2]string{"token", r.GetToken()})
}
