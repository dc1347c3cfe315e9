package limits

import (
	_ "embed"

	"github.com/redis/go-redis/v9"
)

// The scripts share lua/common.lua, which is prepended to each of them; the
// SHA go-redis sends with EVALSHA is that of the combined text.
var (
	//go:embed lua/common.lua
	commonLua string
	//go:embed lua/admit.lua
	admitLua string
	//go:embed lua/renew.lua
	renewLua string
	//go:embed lua/settle.lua
	settleLua string

	admitScript  = redis.NewScript(commonLua + "\n" + admitLua)
	renewScript  = redis.NewScript(commonLua + "\n" + renewLua)
	settleScript = redis.NewScript(commonLua + "\n" + settleLua)
)
